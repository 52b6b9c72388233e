"""Reading rows from a file, a saved dataset folder or a Python list.

The code is torch-free and lives in the contract (`contract.data_rows`), so that the pre-flight
check that runs before any rank starts reads files exactly as the engine does; this module keeps
the engine's names for it.
"""

from contract.data_rows import (JSON_LINES_SUFFIXES, SUFFIXES, NumberedRows, UnreadableRow,  # noqa: F401
                                load_rows, read_rows)

__all__ = ["JSON_LINES_SUFFIXES", "NumberedRows", "SUFFIXES", "UnreadableRow", "load_rows", "read_rows"]
