"""memory_pool: embedding tables in a tiered, persistent memory pool.

>>> from memory_pool import MemoryPool
>>> with MemoryPool.create("/tmp/p", tier="auto") as pool:
...     t = pool.create_table("user", 1000, 64, init="uniform")
...     t.write(torch.tensor([3]), torch.ones(1, 64))
...     pool.persist()
"""

from .errors import *  # noqa: F401,F403
from .errors import __all__ as _errors_all
from .lifecycle import RegionInfo, find_regions, gc, record_owner
from .pool import FORMAT_VERSION, MemoryPool, PoolStats, Table, TableConfig, destroy_pool, read_header
from . import fileio
from .durable import atomic_write, fsync_dir, json_crc, json_with_crc, parse_json_object
from .gather import TouchedRows
from .records import Fill
from .rowsets import DistinctRows, distinct_sorted, first_touch
from .threads import InOrder, intra_op_threads, one_intra_op_thread
from .tiers import TIERS
from .validation import env_mib
from .transaction import Transaction, decode_logged_mark, decode_row_set, record_kind, undo_group_of

__all__ = ["MemoryPool", "Table", "TableConfig", "PoolStats", "TIERS", "FORMAT_VERSION",
           "destroy_pool", "read_header", "Transaction", "record_kind", "decode_row_set", "decode_logged_mark",
           "undo_group_of", "TouchedRows", "DistinctRows", "distinct_sorted", "first_touch",
           # what checkpointing needs besides (durable files, the I/O layer, a lazily filled record part)
           "fileio", "atomic_write", "fsync_dir", "json_crc", "json_with_crc", "parse_json_object", "Fill",
           "one_intra_op_thread", "intra_op_threads", "InOrder", "env_mib", "RegionInfo", "record_owner", "find_regions", "gc", *_errors_all]
