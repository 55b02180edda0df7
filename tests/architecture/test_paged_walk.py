"""One decode token's walk through the paged road reads in one direction (issue 27).

The coordinator (the loop) asks the scheduler for a step; the scheduler asks the constraints for
its masks and, after the outcome, tells them the accepted tokens; the step goes down the ring path
to the stages and its outcome comes back on the path's queue, never by a call up. On the import
graph that is: the scheduler and its pure helpers import none of the loop and I/O modules; the
stages' side (ring path, stage, worker) imports no coordinator; inside ``engine.paged`` only the
scheduler imports the constraints (the coordinator never touches grammar state). Every import
counts (module level, in a function, under ``TYPE_CHECKING``). The rules are checked on the real
tree, and on a made-up graph with each kind of reach-back added, so the check can fail.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping

import grimp

P = "engine.paged."
# The scheduler and what it decides with: pure, no sockets, no OpenVINO, no loop.
PURE = tuple(P + m for m in ("scheduler", "stream_book", "step_composer", "outcome_accountant", "flight", "state",
                             "reply", "block_pool", "prefix_blocks", "prefix_admission", "constraints",
                             "speculation_policy", "step"))
# The loop and the I/O around it: what the pure modules must never reach.
LOOP_AND_IO = tuple(P + m for m in ("coordinator", "ring_path", "worker", "stage", "speculation", "draft_model"))
# The stages' side of the walk: the outcome goes back on a queue, not by a call into the coordinator.
STAGE_SIDE = (P + "ring_path", P + "stage", P + "worker", "engine.ring.ends", "engine.shards.step_answer",
              "engine.wire.step_codec")
CONSTRAINTS = P + "constraints"
CONSTRAINTS_OWNER = P + "scheduler"


def walk_violations(modules: set[str], imports: Callable[[str], set[str]],
                    reaches: Callable[[str, str], bool]) -> list[str]:
    """The reach-backs on a graph: ``imports(m)`` the modules ``m`` imports directly, ``reaches(a, b)``
    whether ``a`` imports ``b`` directly or through others."""
    found = [f"{pure} reaches {io}" for pure in PURE for io in LOOP_AND_IO
             if pure in modules and io in modules and reaches(pure, io)]
    found += [f"{side} reaches {P}coordinator" for side in STAGE_SIDE
              if side in modules and P + "coordinator" in modules and reaches(side, P + "coordinator")]
    found += [f"{m} imports {CONSTRAINTS} (only {CONSTRAINTS_OWNER} may)" for m in sorted(modules)
              if m.startswith(P) and m != CONSTRAINTS_OWNER and CONSTRAINTS in imports(m)]
    return found


def _on(edges: Mapping[str, set[str]]) -> list[str]:
    modules = set(edges) | {m for targets in edges.values() for m in targets}

    def reaches(a: str, b: str) -> bool:
        seen, todo = set(), [a]
        while todo:
            m = todo.pop()
            for n in edges.get(m, set()):
                if n == b:
                    return True
                if n not in seen:
                    seen.add(n)
                    todo.append(n)
        return False

    return walk_violations(modules, lambda m: edges.get(m, set()), reaches)


def test_the_paged_walk_reads_in_one_direction() -> None:
    graph = grimp.build_graph("engine", cache_dir=None)
    found = walk_violations(set(graph.modules), graph.find_modules_directly_imported_by,
                            lambda a, b: graph.chain_exists(importer=a, imported=b))
    assert not found, "the paged walk returns to a module it left:\n" + "\n".join(found)


def test_the_check_catches_each_kind_of_reach_back() -> None:
    one_way = {P + "coordinator": {P + "scheduler", P + "ring_path", P + "step"},
               P + "scheduler": {P + "constraints", P + "state", P + "reply", P + "step"},
               P + "constraints": {P + "state", P + "step"}, P + "ring_path": {P + "step", "engine.ring.ends"}}
    assert _on(one_way) == []
    assert _on({**one_way, P + "reply": {P + "ring_path"}}) == [  # the scheduler through its helper
        f"{P}scheduler reaches {P}ring_path", f"{P}reply reaches {P}ring_path"]
    indirect = _on({**one_way, P + "state": {P + "speculation"}, P + "speculation": {P + "coordinator"}})
    assert f"{P}scheduler reaches {P}coordinator" in indirect and f"{P}state reaches {P}coordinator" in indirect
    assert _on({**one_way, "engine.ring.ends": {P + "coordinator"}}) == [
        f"{P}ring_path reaches {P}coordinator", f"engine.ring.ends reaches {P}coordinator"]
    coordinator_masks = {**one_way, P + "coordinator": one_way[P + "coordinator"] | {CONSTRAINTS}}
    assert _on(coordinator_masks) == [f"{P}coordinator imports {CONSTRAINTS} (only {CONSTRAINTS_OWNER} may)"]
