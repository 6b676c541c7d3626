"""Who owns an shm region, and removing the regions whose pool is gone.

An shm pool keeps its rows outside its directory, in ``<shm root>/dlrm-cxl-<pool id>/``
(``/dev/shm`` unless ``DLRM_CXL_SHM_DIR`` says otherwise). ``destroy_pool`` removes both, but
deleting the directory by hand (``rm -rf runs/pool``) leaves the region behind, in RAM. So that
such regions can be found, ``MemoryPool.create`` writes an ``OWNER`` record into every region it
makes (:func:`record_owner`); :func:`find_regions` reports each region's status and :func:`gc`
removes the orphaned ones.

Statuses:

``in-use``   the owner directory holds a pool whose ``pool.json`` names this region's pool id
``locked``   a writer holds the owner's ``LOCK`` (also while a pool is being created)
``orphan``   the owner directory is gone, or holds no ``pool.json``, or one naming another pool
``unknown``  who owns it cannot be established: no (or a damaged) ``OWNER`` record -- a region
             made before owners were recorded -- or the owner's files cannot be read

Only ``orphan`` regions are ever removed. The owner is recorded by path: a pool directory moved
(or copied) elsewhere by hand still names its region, but the region names the old path, so after
``mv`` the region reads as ``orphan``. Run ``dlrm-cxl gc --dry-run`` first.
"""

from __future__ import annotations

import json
import os
import shutil
import stat
from dataclasses import dataclass
from pathlib import Path

from .durable import atomic_write, json_crc
from .header import HEADER
from .persistence import stale_marks
from .tiers import TIERS, shm_root, tier_of
from .writer_lock import LOCK_FILE, lock_held, try_lock

__all__ = ["RegionInfo", "record_owner", "find_regions", "gc", "region_bytes", "owns_region", "OWNER_FILE",
           "REGION_PREFIX"]

OWNER_FILE = "OWNER"
REGION_PREFIX = "dlrm-cxl-"

IN_USE, LOCKED, ORPHAN, UNKNOWN = "in-use", "locked", "orphan", "unknown"


@dataclass(frozen=True)
class RegionInfo:
    """One ``dlrm-cxl-*`` region under the shm root."""

    path: Path              # the region directory
    pool_id: str            # from OWNER when present, else from the directory name
    owner: Path | None      # the pool directory OWNER names; None without a readable OWNER
    size_bytes: int         # memory the region's files hold (allocated blocks)
    status: str             # in-use | locked | orphan | unknown
    reason: str             # one line saying why it has that status

    def as_dict(self) -> dict:
        return {"path": str(self.path), "pool_id": self.pool_id,
                "owner": None if self.owner is None else str(self.owner),
                "size_bytes": self.size_bytes, "status": self.status, "reason": self.reason}


def owns_region(header: dict, storage: Path) -> bool:
    """Whether the pool of ``header`` owns the shm region ``storage`` (its ``storage_dir``): only
    an shm pool has files outside its directory, in its own region named after its id. The
    storage_dir of other tiers is where the pool was created, which for a copied or moved pool
    is another pool's directory."""
    tier = header.get("tier")
    return tier in TIERS and tier_of(tier).files_in_shm and storage.name == f"{REGION_PREFIX}{header.get('pool_id')}"


def _crc(body: dict) -> int:
    return json_crc(body)


def record_owner(region_dir: Path, pool_dir: Path, pool_id: str) -> None:
    """Write ``region_dir/OWNER``: the (absolute) pool directory and pool id, with a crc32 of
    their canonical JSON. Atomic and durable (tmp, fsync, rename, fsync dir)."""
    pool_dir = Path(pool_dir)
    if not pool_dir.is_absolute():
        raise ValueError(f"record_owner: pool_dir must be absolute, got {str(pool_dir)!r}")
    body = {"pool_dir": str(pool_dir), "pool_id": str(pool_id)}
    doc = {**body, "crc32": _crc(body)}
    atomic_write(Path(region_dir) / OWNER_FILE, (json.dumps(doc, indent=1, sort_keys=True) + "\n").encode())


def _read_owner(region: Path) -> tuple[Path, str] | None:
    """(pool dir, pool id) from the region's OWNER, or None when it is missing or damaged."""
    try:
        doc = json.loads((region / OWNER_FILE).read_bytes())
        body = {"pool_dir": doc["pool_dir"], "pool_id": doc["pool_id"]}
        if (not isinstance(body["pool_dir"], str) or not isinstance(body["pool_id"], str)
                or doc.get("crc32") != _crc(body) or not os.path.isabs(body["pool_dir"])):
            return None
    except (OSError, ValueError, UnicodeDecodeError, TypeError, KeyError):
        return None
    return Path(body["pool_dir"]), body["pool_id"]


def region_bytes(region: str | os.PathLike) -> int:
    """Bytes of memory the files under ``region`` hold (allocated blocks; 0 when it is gone)."""
    total = 0
    for dirpath, _dirs, files in os.walk(region):  # does not follow symlinks
        for f in files:
            try:
                total += os.lstat(os.path.join(dirpath, f)).st_blocks * 512
            except OSError:
                pass
    return total


def _classify(region: Path, owner: tuple[Path, str] | None, *, probe_lock: bool = True) -> tuple[str, str]:
    if owner is None:
        return UNKNOWN, f"no readable {OWNER_FILE} record (made before owners were recorded?)"
    pool_dir, pool_id = owner
    if region.name != REGION_PREFIX + pool_id:
        return UNKNOWN, f"{OWNER_FILE} names pool id {pool_id}, not this region's"
    try:
        st = os.stat(pool_dir)
    except (FileNotFoundError, NotADirectoryError):
        return ORPHAN, f"pool directory {pool_dir} is gone"
    except OSError as exc:
        return UNKNOWN, f"cannot check {pool_dir}: {exc.strerror}"
    if not stat.S_ISDIR(st.st_mode):
        return ORPHAN, f"{pool_dir} is no longer a directory"
    # The lock before the header: a pool being created holds its lock until pool.json is written
    # (and create removes its region if it fails), so an unlocked owner's header is final.
    if probe_lock:
        held = lock_held(pool_dir)
        if held is None:
            return UNKNOWN, f"cannot try the lock {pool_dir / LOCK_FILE}"
        if held:
            return LOCKED, f"a writer holds {pool_dir / LOCK_FILE}"
    try:
        raw = (pool_dir / HEADER).read_bytes()
    except (FileNotFoundError, NotADirectoryError):
        return ORPHAN, f"{pool_dir} holds no {HEADER}"
    except OSError as exc:
        return UNKNOWN, f"cannot read {pool_dir / HEADER}: {exc.strerror}"
    try:
        named = json.loads(raw)["pool_id"]
    except (ValueError, TypeError, KeyError, IndexError):
        return UNKNOWN, f"{pool_dir / HEADER} is damaged"
    if named == pool_id:
        return IN_USE, f"pool {pool_dir}"
    return ORPHAN, f"{pool_dir} now holds another pool ({named})"


def _regions() -> list[Path]:
    root = shm_root()
    try:
        entries = list(os.scandir(root))
    except (FileNotFoundError, NotADirectoryError):
        return []
    return sorted(Path(e.path) for e in entries
                  if e.name.startswith(REGION_PREFIX) and e.is_dir(follow_symlinks=False))


def _info(region: Path, owner: tuple[Path, str] | None) -> RegionInfo:
    status, reason = _classify(region, owner)
    pool_id = owner[1] if owner is not None else region.name[len(REGION_PREFIX):]
    return RegionInfo(region, pool_id, owner[0] if owner else None, region_bytes(region), status, reason)


def find_regions() -> list[RegionInfo]:
    """Every ``dlrm-cxl-*`` directory under ``shm_root()``, with its owner, size and status."""
    return [_info(r, _read_owner(r)) for r in _regions()]


def _within(path: Path, root: Path) -> bool:
    return path == root or root in path.parents


def _remove_orphan(info: RegionInfo) -> bool:
    """Remove an orphaned region, re-checked under the owner's lock (if the owner directory
    still has one), so that a writer never finds its region gone. True once it is gone."""
    fd = None
    if info.owner is not None:
        try:
            fd = os.open(info.owner / LOCK_FILE, os.O_RDONLY)
        except (FileNotFoundError, NotADirectoryError):
            fd = None
        except OSError:
            return False
    try:
        if fd is not None:
            try:
                taken = try_lock(fd)
            except OSError:
                taken = False
            if not taken:
                return False  # a writer took it since: no longer an orphan
        status, _ = _classify(info.path, _read_owner(info.path), probe_lock=False)
        if status != ORPHAN:
            return False
        shutil.rmtree(info.path, ignore_errors=True)
        return not os.path.lexists(info.path)
    finally:
        if fd is not None:
            os.close(fd)


def gc(dry_run: bool = False, *, under: str | os.PathLike | None = None) -> list[RegionInfo]:
    """Remove the ``orphan`` regions (never ``in-use``, ``locked`` or ``unknown`` ones) and return
    them; with ``dry_run``, remove nothing and return what would be removed.

    ``under``: only regions whose owner is that directory or inside it (a tool or test cleaning up
    after its own work directory); the other regions are not even looked at.
    """
    root = None if under is None else Path(os.path.abspath(under)).resolve()
    out = []
    for region in _regions():
        owner = _read_owner(region)
        if root is not None and (owner is None or not _within(owner[0], root)):
            continue
        info = _info(region, owner)
        if info.status != ORPHAN:
            continue
        if dry_run or _remove_orphan(info):
            out.append(info)
    if not dry_run:
        # The applied marks of pools that are gone (persistence.AppliedMark: a few hundred bytes
        # each, vouching for nothing once their pool is gone) go too, without a report.
        for mark in stale_marks(root):
            mark.unlink(missing_ok=True)
    return out
