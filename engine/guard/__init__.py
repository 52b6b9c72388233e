"""The spike guard: its pure decisions (decisions) and the callback that feeds them from the loop (hook)."""
