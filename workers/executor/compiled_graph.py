"""The Ray compiled graph that carries each step to a replica group's workers: building it,
and tearing it down without Ray's error logs for actors we killed or a process left behind.

The graph sends one message through shared-memory channels to every worker's `execute_step`
and returns each worker's result (RayExecutor reads TP rank 0 of the last stage's).
"""

from __future__ import annotations

import logging
from typing import Any

logger = logging.getLogger(__name__)


def compile_step_graph(workers: list[Any], submit_timeout_s: float) -> Any:
    """One step message in, every worker's result out."""
    from ray.dag import InputNode, MultiOutputNode

    with InputNode() as step:
        dag = MultiOutputNode([w.execute_step.bind(step) for w in workers])
    return dag.experimental_compile(_submit_timeout=submit_timeout_s)


def quiet_teardown(dag: Any, level: int) -> None:
    """Tear down a compiled graph, keeping Ray's teardown logs below `level` out of the output,
    and end the actor it made on this node.

    A graph creates a driver proxy actor (`CompiledDAG.DAGDriverProxyActor`, a process of
    its own) that Ray ends only when the graph object is freed. After a worker's death the
    graph sits in reference cycles through the errors' tracebacks (Ray's monitor thread and
    our step's), which only a full collection frees, and a quiet process may not run one for
    a long time: each failed group would leave its proxy process behind.
    """
    import ray

    saved = _DAG_LOGGER.level
    _DAG_LOGGER.setLevel(level)
    try:
        dag.teardown()
    except Exception:  # the actors are killed right after (or were before) anyway
        logger.debug("compiled graph teardown failed", exc_info=True)
    finally:
        _DAG_LOGGER.setLevel(saved)
    proxy = getattr(dag, "_proxy_actor", None)  # Ray's name for it (ray/dag/compiled_dag_node.py)
    if proxy is not None:
        try:
            ray.kill(proxy)
        except Exception:  # pragma: no cover - already gone
            pass


class _KilledActorFilter(logging.Filter):
    """Drops Ray's traceback for cancelling a compiled graph's loop on an actor we killed.

    When a worker fails, the graph's monitor thread tears the graph down on its own, while
    `RayExecutor._fail` kills the group; each dead actor would otherwise be logged as an error.
    """

    def filter(self, record: logging.LogRecord) -> bool:
        from ray.exceptions import RayActorError

        exc = record.exc_info[1] if record.exc_info else None
        return not (record.getMessage() == "Error cancelling worker task" and isinstance(exc, RayActorError))


_DAG_LOGGER = logging.getLogger("ray.dag.compiled_dag_node")
_DAG_LOGGER.addFilter(_KilledActorFilter())
