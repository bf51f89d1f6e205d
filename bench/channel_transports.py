"""What each candidate channel costs to carry a group's flushes to an ingress (issue 42's
"measure before choosing"): a TCP socket (what tandem uses) against a Ray compiled graph.

Two actors on this node stand for a group and an ingress. The group makes one flush per
simulated step (a pickled batch of `--deltas` deltas, ~75 bytes each), paced at `--rate` flushes
a second as a GPU's steps come, or as fast as it can (`--rate 0`); the ingress reads them.
Reported per transport: flushes a second carried, and the CPU both actors used per flush
(from /proc). A compiled graph's reader is its driver: the ingress executes the graph once per
flush and awaits the group's batch.

    python3 -m tandem.bench.channel_transports [--flushes 1000] [--rate 140] [--deltas 128]
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import socket
import time
from typing import Any

from tandem.bench.process_cpu import cpu_seconds
from tandem.workers.serving.channel_server import HEADER_BYTES, frame


def _batch(num_deltas: int) -> bytes:
    from tandem.workers.core.request import CompletionOutput
    from tandem.workers.serving.messages import DeltaBatch, GroupDelta, encode_batch

    deltas = [GroupDelta(f"cmpl-{i:032x}-0", "group1234", [CompletionOutput(0, " tok", [1234], None)], False,
                         num_prompt_tokens=100) for i in range(num_deltas)]
    return encode_batch(DeltaBatch(deltas))


def _actors():
    import ray

    @ray.remote(num_cpus=0)
    class Group:
        def __init__(self, num_deltas: int) -> None:
            self.payload = _batch(num_deltas)
            self.next_at = 0.0

        def pid(self) -> int:
            return os.getpid()

        def flush(self, rate: float) -> bytes:
            """One flush, when the next simulated step ends (compiled graph: called per flush)."""
            if rate:
                now = time.monotonic()
                self.next_at = max(self.next_at + 1.0 / rate, now)
                if self.next_at > now:
                    time.sleep(self.next_at - now)
            return self.payload

        def send(self, address: tuple[str, int], count: int, rate: float) -> None:
            """`count` flushes on a socket to the ingress, paced as steps."""
            sock = socket.create_connection(address)
            sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
            for _ in range(count):
                payload = self.flush(rate)
                sock.sendall(frame(payload))
            sock.close()

    @ray.remote(num_cpus=0)
    class Ingress:
        def pid(self) -> int:
            return os.getpid()

        async def read_socket(self, group: Any, pids: list[int], count: int, rate: float) -> tuple[float, list[float]]:
            got = 0
            done = asyncio.get_running_loop().create_future()

            async def serve(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
                nonlocal got
                while got < count:
                    size = int.from_bytes(await reader.readexactly(HEADER_BYTES), "big")
                    await reader.readexactly(size)
                    got += 1
                done.set_result(True)

            server = await asyncio.start_server(serve, "127.0.0.1", 0)
            cpu = [cpu_seconds(p) for p in pids]
            start = time.monotonic()
            sending = group.send.remote(server.sockets[0].getsockname(), count, rate)
            await done
            elapsed = time.monotonic() - start
            cpu = [cpu_seconds(p) - c for p, c in zip(pids, cpu)]
            await sending
            server.close()
            return elapsed, cpu

        def read_graph(self, group: Any, pids: list[int], count: int, rate: float) -> tuple[float, list[float]]:
            from ray.dag import InputNode

            with InputNode() as inp:
                dag = group.flush.bind(inp)
            graph = dag.experimental_compile()
            try:
                graph.execute(rate).get()  # warm
                cpu = [cpu_seconds(p) for p in pids]
                start = time.monotonic()
                for _ in range(count):
                    graph.execute(rate).get()
                elapsed = time.monotonic() - start
                return elapsed, [cpu_seconds(p) - c for p, c in zip(pids, cpu)]
            finally:
                graph.teardown()

    return Group, Ingress


def measure(transport: str, flushes: int, rate: float, num_deltas: int) -> dict[str, float]:
    import ray

    Group, Ingress = _actors()
    group, ingress = Group.remote(num_deltas), Ingress.remote()
    pids = ray.get([group.pid.remote(), ingress.pid.remote()])
    read = ingress.read_socket if transport == "socket" else ingress.read_graph
    # CPU over the flushes alone (the reader reads it around them: not the graph's compiling)
    elapsed, cpu = ray.get(read.remote(group, pids, flushes, rate))
    for actor in (group, ingress):
        ray.kill(actor)
    return {f"{transport}_flushes_per_s": flushes / elapsed,
            f"{transport}_group_cpu_us_per_flush": cpu[0] / flushes * 1e6,
            f"{transport}_ingress_cpu_us_per_flush": cpu[1] / flushes * 1e6}


def main(argv: list[str] | None = None) -> None:
    import ray

    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--flushes", type=int, default=1000)
    p.add_argument("--rate", type=float, default=140.0, help="flushes a second (a GPU's steps); 0: flat out")
    p.add_argument("--deltas", type=int, default=128, help="deltas a flush carries (streams with a token)")
    p.add_argument("--repeats", type=int, default=3, help="runs of each transport, interleaved (the median)")
    p.add_argument("--output-json", default=None)
    args = p.parse_args(argv)
    ray.init(address="local", num_cpus=2, include_dashboard=False, log_to_driver=False)
    figures: dict[str, Any] = {"flushes": args.flushes, "rate": args.rate, "deltas": args.deltas,
                               "flush_bytes": len(_batch(args.deltas))}
    runs: dict[str, list[dict[str, float]]] = {"socket": [], "graph": []}
    for _ in range(args.repeats):  # interleaved
        for transport in runs:
            runs[transport].append(measure(transport, args.flushes, args.rate, args.deltas))
    for results in runs.values():
        for key in results[0]:
            values = sorted(r[key] for r in results)
            figures[key] = values[len(values) // 2]
    ray.shutdown()
    print(json.dumps(figures, indent=1))
    if args.output_json:
        with open(args.output_json, "w") as f:
            json.dump(figures, f, indent=1)


if __name__ == "__main__":
    main()
