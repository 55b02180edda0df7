"""The memory an agent reports: the machine's RAM capped by its cgroup's limit, read from a fake
cgroup tree (v1 and v2 layouts, nested limits, no limit, a cgroup namespace); and the stage worker's
launch refused when its stage would not fit that memory (pure)."""

from __future__ import annotations

from pathlib import Path

from agent.service.pc_facts import CgroupMemory, capped_memory, cgroup_memory
from agent.service.worker_launch import WORKER_BASE_BYTES, memory_refusal, stage_memory_need
from engine.control.messages import Assignment, WorkerSettings

GIB = 1 << 30
V1_NONE = "9223372036854771712"


def write(path: Path, **files: str) -> Path:
    path.mkdir(parents=True, exist_ok=True)
    for name, text in files.items():
        (path / name.replace("__", ".")).write_text(text + "\n")
    return path


def v1_tree(root: Path, *, top: str = V1_NONE, leaf: str = V1_NONE, usage: int = 0, cache: int = 0) -> str:
    write(root / "memory", memory__limit_in_bytes=V1_NONE)
    write(root / "memory" / "office", memory__limit_in_bytes=top)
    write(root / "memory" / "office" / "pc1", memory__limit_in_bytes=leaf, memory__usage_in_bytes=str(usage),
          memory__stat=f"cache {cache}\ntotal_inactive_file {cache // 4}\ntotal_active_file {cache - cache // 4}\n")
    write(root / "cpu")
    return "5:cpu,cpuacct:/\n4:memory:/office/pc1\n0::/\n"


def test_v1_leaf_limit(tmp_path: Path) -> None:
    text = v1_tree(tmp_path, leaf=str(3 * GIB), usage=GIB)
    assert cgroup_memory(text, tmp_path) == CgroupMemory(3 * GIB, GIB)


def test_v1_an_ancestors_limit_is_the_cap(tmp_path: Path) -> None:
    text = v1_tree(tmp_path, top=str(2 * GIB), leaf=str(3 * GIB))
    assert cgroup_memory(text, tmp_path).limit_bytes == 2 * GIB


def test_v1_no_limit(tmp_path: Path) -> None:
    assert cgroup_memory(v1_tree(tmp_path), tmp_path).limit_bytes is None


def test_v1_page_cache_is_not_in_use(tmp_path: Path) -> None:
    """Files' pages, active or not (a shard just fetched), are dropped before the OOM killer acts."""
    text = v1_tree(tmp_path, leaf=str(3 * GIB), usage=2 * GIB, cache=GIB // 2)
    assert cgroup_memory(text, tmp_path).in_use_bytes == 2 * GIB - GIB // 2


def test_v1_path_outside_the_mount_reads_its_top(tmp_path: Path) -> None:
    """A cgroup namespace shows a path the mount does not have: the hierarchy's top is the process's."""
    write(tmp_path / "memory", memory__limit_in_bytes=str(GIB), memory__usage_in_bytes="0")
    assert cgroup_memory("4:memory:/elsewhere/pc\n", tmp_path).limit_bytes == GIB


def test_v2(tmp_path: Path) -> None:
    write(tmp_path, cgroup__controllers="cpu memory", memory__max="max")
    write(tmp_path / "office", memory__max=str(4 * GIB))
    write(tmp_path / "office" / "pc2", memory__max="max", memory__current=str(GIB),
          memory__stat=f"anon {GIB}\ninactive_file 7\nactive_file 3\n")
    assert cgroup_memory("0::/office/pc2\n", tmp_path) == CgroupMemory(4 * GIB, GIB - 10)


def test_v2_no_limit(tmp_path: Path) -> None:
    write(tmp_path, cgroup__controllers="memory")
    write(tmp_path / "a", memory__max="max", memory__current="5")
    assert cgroup_memory("0::/a\n", tmp_path) == CgroupMemory(None, 5)


def test_no_cgroup_information(tmp_path: Path) -> None:
    assert cgroup_memory("", tmp_path) == CgroupMemory()
    assert cgroup_memory("garbage\n", tmp_path) == CgroupMemory()


def test_cap_takes_the_smaller_and_leaves_what_the_group_has_free() -> None:
    cap = CgroupMemory(2 * GIB, GIB // 2)
    assert cap.cap(24 * GIB, 20 * GIB) == (2 * GIB, GIB + GIB // 2)
    assert cap.cap(GIB, GIB // 4) == (GIB, GIB // 4)  # a machine smaller than the limit
    assert CgroupMemory(GIB, 2 * GIB).cap(8 * GIB, 8 * GIB) == (GIB, 0)  # over its limit: nothing free
    assert CgroupMemory().cap(8 * GIB, 3 * GIB) == (8 * GIB, 3 * GIB)


def test_capped_inventory() -> None:
    inventory = {"ram_total": 24 * GIB, "ram_available": 20 * GIB, "devices": []}
    assert capped_memory(inventory, CgroupMemory(3 * GIB, GIB)) == {
        "ram_total": 3 * GIB, "ram_available": 2 * GIB, "devices": []}
    assert capped_memory(inventory, CgroupMemory()) is inventory


def _assignment(export: Path, runtime: str = "paged") -> Assignment:
    return Assignment.create((export / "manifest.json").read_text(), export_id="tiny-2", stage=1, source="https://x/",
                             listen_port=1, next_hop="127.0.0.1:2", worker=WorkerSettings(threads=1), runtime=runtime)


def test_a_stage_that_does_not_fit_is_refused_naming_its_need_and_the_pcs_memory(tiny_export) -> None:
    assignment = _assignment(tiny_export("llama", 2))
    need, weights, pool = stage_memory_need(assignment, kv_pool_mb=64)
    assert pool == 64 << 20 and weights > 0 and need == WORKER_BASE_BYTES + weights + pool
    assert memory_refusal(assignment, kv_pool_mb=64, available_bytes=need, total_bytes=GIB) is None
    why = memory_refusal(assignment, kv_pool_mb=64, available_bytes=need - (1 << 20), total_bytes=GIB)
    assert why is not None
    assert f"needs {need >> 20} MiB" in why and f"has {(need >> 20) - 1} MiB free of its 1024 MiB" in why, why
    assert memory_refusal(assignment, kv_pool_mb=64, available_bytes=None) is None  # unknown: the worker tries


def test_a_static_stage_has_no_pool_to_count(tiny_export) -> None:
    assignment = _assignment(tiny_export("llama", 2), runtime="static")
    need, weights, pool = stage_memory_need(assignment, kv_pool_mb=64)
    assert pool == 0 and need == WORKER_BASE_BYTES + weights
