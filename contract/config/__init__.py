"""The run config: its sections as typed models (schema), reading a file with overrides (load),
the checks across fields (checks, layout_checks, preference_checks) and the form the front ends
draw from the schema (form)."""
