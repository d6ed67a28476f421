"""Remote (lazy) snapshots: labels -> layer, resolve within a deadline, persist, mount."""
