"""Reading rows from a file, a saved dataset folder or a Python list.

The code is torch-free and lives in the contract (`contract.data_rows`), so that the pre-flight
check that runs before any rank starts reads files exactly as the engine does; this module keeps
the engine's names for it.
"""


__all__ = []
