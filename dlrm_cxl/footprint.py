"""How big a pool is, and what it is made of: what ``dlrm-cxl inspect`` shows.

:func:`pool_footprint` measures the files of a pool by part -- the embedding tables, their
optimizer state, the journal, the row overlay's runs, and the rest (header, lock, checkpoint
markers, ``metrics.jsonl``, the applied mark) -- as the bytes allocated to them (``du``: what they
take, not their apparent size), each on **disk** or in **memory** (a file on tmpfs or ramfs, e.g.
``/dev/shm``: an shm pool's tables and journal live there, and RAM is what they take).

:func:`group_tables` pairs each embedding table with its optimizer-state tables: a trainer pool
holds 26 embedding tables and, with row-wise Adagrad, 26 ``<table>.adagrad`` tables beside them
(``inspect`` lists 26 tables, each with its optimizer state, not 52).

Light: imports neither torch nor TorchRec (``inspect`` starts fast).
"""

from __future__ import annotations

import os
from pathlib import Path

__all__ = ["PARTS", "pool_footprint", "group_tables"]

# The parts of a pool, in the order inspect shows them.
PARTS = ("tables", "optimizer_state", "journal", "runs", "other")

_MEMORY_FS = frozenset({"tmpfs", "ramfs", "hugetlbfs"})


def _mounts() -> list[tuple[str, str]]:
    """(mount point, file system type) of every mount this process sees, longest first."""
    out = []
    try:
        with open("/proc/self/mountinfo") as f:
            for line in f:
                left, _, right = line.partition(" - ")
                fields = left.split()
                if len(fields) < 5 or not right:
                    continue
                point = fields[4].replace("\\040", " ")
                out.append((point, right.split()[0]))
    except OSError:
        pass
    return sorted(out, key=lambda m: len(m[0]), reverse=True)


def _in_memory(path: Path, mounts: list[tuple[str, str]]) -> bool:
    real = os.path.realpath(path)
    for point, fstype in mounts:
        if real == point or real.startswith(point.rstrip("/") + "/"):
            return fstype in _MEMORY_FS
    return False


def _state_owner(names: list[str], features: list[str]) -> dict[str, str]:
    """Optimizer-state table -> the embedding table it belongs to (``<table>.<state>``, e.g.
    ``cat_0.adagrad``: model.state_table_name)."""
    feats = set(features)
    owner = {}
    for n in names:
        base, dot, _ = n.rpartition(".")
        if dot and base in feats:
            owner[n] = base
    return owner


def _features(tables: list[dict], meta: dict) -> list[str]:
    model = meta.get("model") if isinstance(meta, dict) else None
    names = [t["name"] for t in tables]
    if isinstance(model, dict) and isinstance(model.get("feature_names"), list):
        return [f for f in model["feature_names"] if f in set(names)]
    # (a pool made through the API: a table named <other table>.<x> is that table's state)
    return [n for n in names if not (n.rpartition(".")[1] and n.rpartition(".")[0] in set(names))]


def group_tables(tables: list[dict], meta: dict) -> dict:
    """``{"embedding": [...], "other": [...]}``: each embedding table (a ``describe()`` entry of
    the pool's tables) with ``"optimizer_state"``, the list of its optimizer-state tables (empty
    for SGD), and the bytes of both; ``other``: any table that is neither."""
    by_name = {t["name"]: t for t in tables}
    features = _features(tables, meta)
    owner = _state_owner(list(by_name), features)
    grouped = []
    for f in features:
        t = dict(by_name[f])
        states = [by_name[s] for s, o in owner.items() if o == f]
        t["optimizer_state"] = states
        t["bytes_with_state"] = t["bytes"] + sum(s["bytes"] for s in states)
        grouped.append(t)
    placed = set(features) | set(owner)
    return {"embedding": grouped, "other": [t for t in tables if t["name"] not in placed]}


def _allocated(st: os.stat_result) -> int:
    return st.st_blocks * 512 if hasattr(st, "st_blocks") else st.st_size


def pool_footprint(path, header: dict) -> dict:
    """Bytes a pool takes, by part (:data:`PARTS`) and medium.

    Returns ``{"parts": {part: {"disk": bytes, "memory": bytes}}, "disk": total, "memory":
    total, "files": count}``. ``header``: the pool's ``pool.json`` (its tables, ``storage_dir``,
    ``pool_id``, ``meta``). A file that vanishes meanwhile (a compaction drops a segment) is
    skipped."""
    from memory_pool.persistence import APPLIED_PREFIX
    from memory_pool.tiers import shm_root

    path = Path(path)
    storage = Path(header.get("storage_dir") or path)
    if not storage.is_dir():
        storage = path
    tables = header.get("tables", [])
    names = [t["name"] for t in tables]
    owner = _state_owner(names, _features([{"name": n} for n in names], header.get("meta", {})))
    mounts = _mounts()
    parts = {p: {"disk": 0, "memory": 0} for p in PARTS}
    seen: set[tuple[int, int]] = set()
    files = 0

    def part_of(f: Path) -> str:
        try:
            rel = f.relative_to(storage)
        except ValueError:
            return "other"
        top = rel.parts[0] if rel.parts else ""
        if top == "tables" and len(rel.parts) == 2 and f.suffix == ".bin":
            return "optimizer_state" if f.name[:-len(".bin")] in owner else "tables"
        if top in ("journal", "runs"):
            return top
        return "other"

    roots = [path] + ([storage] if storage.resolve() != path.resolve() else [])
    candidates: list[Path] = []
    for root in roots:
        for d, _, fs in os.walk(root):
            candidates.extend(Path(d) / x for x in fs)
    pool_id = header.get("pool_id")
    if pool_id:
        candidates.extend(shm_root().glob(f"{APPLIED_PREFIX}{pool_id}.*"))
    for f in candidates:
        try:
            st = os.lstat(f)
        except OSError:
            continue
        if not os.path.isfile(f) or os.path.islink(f) or (st.st_dev, st.st_ino) in seen:
            continue
        seen.add((st.st_dev, st.st_ino))
        files += 1
        medium = "memory" if _in_memory(f, mounts) else "disk"
        parts[part_of(f)][medium] += _allocated(st)
    return {"parts": parts, "disk": sum(p["disk"] for p in parts.values()),
            "memory": sum(p["memory"] for p in parts.values()), "files": files}
