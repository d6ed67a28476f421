"""Why a reader fetches bytes, as its statistics and the daemon's metrics count them."""

# "on_demand": a read; "prefetch": `LayerReader.prefetch`; "background": read-ahead and background fill.
FETCH_CAUSES = ("on_demand", "prefetch", "background")
