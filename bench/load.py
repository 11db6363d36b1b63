"""Bounded loopback load test of `itmatch serve`: N requests from C concurrent clients, then stop.

    python bench/load.py INDEX_DIR [--requests 2000] [--concurrency 32] [--max-seconds 300] [--json OUT]
                         [--captions FILE] [--ensemble INDEX2]

Starts the server as a subprocess on 127.0.0.1 (a free port), waits for /health, sends 200 warm-up
requests at full concurrency, reads the server's RSS and CPU time, then sends exactly --requests
requests from --concurrency clients, a mix: 80% text search, 10% attention maps (text searches instead where
the model draws none), 10% photo files; with --captions (the server's caption collection), 10% photo uploads to
/api/search/image in place of that many text searches, each the bytes of one of the first 50 indexed photos;
with --ensemble, the server ranks by the mean of both indexes' models. Then it reads RSS and CPU time again,
prints throughput, p50/p99 latency per kind and overall, the error count, both RSS figures and the server's CPU
time per request, and stops the server. Traffic goes to the loopback address only; the run ends after
--requests requests or --max-seconds, whichever comes first.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import random
import signal
import socket
import statistics
import subprocess
import sys
import time
from pathlib import Path

import httpx

from itmatch.retrieval.names import public_id
from itmatch.retrieval.service import image_url

QUERIES = [
    "a red circle", "two blue squares", "a large yellow star in the center", "a small green triangle on the left",
    "a white diamond above a black square", "three orange shapes", "a purple circle in the top left corner",
    "a dog jumping over a fence", "a man riding a bike", "two children playing in the water",
]


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _rss_mb(pid: int) -> float:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) / 1024
    return float("nan")


def _cpu_seconds(pid: int) -> float:
    """User + system CPU time of a process (fields 14 and 15 of /proc/PID/stat, in clock ticks)."""
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def _pct(values: list[float], p: float) -> float:
    ordered = sorted(values)
    return round(1000 * ordered[min(len(ordered) - 1, int(p * len(ordered)))], 2) if ordered else float("nan")


async def _run(base: str, ids: list[str], n: int, concurrency: int, deadline: float, seed: int,
               uploads: list[bytes] | None = None, explains: bool = True) -> dict:
    rng = random.Random(seed)
    plan = []
    for _ in range(n):
        r = rng.random()
        q = rng.choice(QUERIES)
        if uploads and r < 0.1:
            plan.append(("upload", "/api/search/image", rng.choice(uploads)))
        elif r < 0.8 or (r < 0.9 and not explains):  # (a model without word attention draws no maps)
            plan.append(("search", "/api/search", {"q": q, "k": 10}))
        elif r < 0.9:
            plan.append(("explain", "/api/explain", {"q": q, "id": rng.choice(ids)}))
        else:
            plan.append(("image", image_url(rng.choice(ids)), None))
    kinds = ("search", *(("explain",) if explains else ()), "image", *(("upload",) if uploads else ()))
    latencies: dict[str, list[float]] = {kind: [] for kind in kinds}
    errors: list[str] = []
    position = 0
    limits = httpx.Limits(max_connections=concurrency, max_keepalive_connections=concurrency)
    async with httpx.AsyncClient(base_url=base, limits=limits, timeout=60) as client:

        async def worker() -> None:
            nonlocal position
            while position < len(plan) and time.monotonic() < deadline:
                kind, path, params = plan[position]
                position += 1
                t = time.perf_counter()
                try:
                    resp = (await client.post(path, content=params, params={"k": 10}) if kind == "upload"
                            else await client.get(path, params=params))
                    if resp.status_code != 200:
                        errors.append(f"{kind} {resp.status_code} {resp.text[:120]}")
                except httpx.HTTPError as exc:
                    errors.append(f"{kind} {type(exc).__name__}")
                latencies[kind].append(time.perf_counter() - t)

        start = time.perf_counter()
        await asyncio.gather(*(worker() for _ in range(concurrency)))
        wall = time.perf_counter() - start
    done = sum(len(v) for v in latencies.values())
    every = [x for v in latencies.values() for x in v]
    return {"requests": done, "planned": n, "concurrency": concurrency, "seconds": round(wall, 2),
            "throughput_rps": round(done / wall, 1), "errors": len(errors), "error_examples": errors[:5],
            "latency_ms": {"all": {"p50": _pct(every, 0.5), "p99": _pct(every, 0.99),
                                   "mean": round(1000 * statistics.fmean(every), 2) if every else None},
                           **{k: {"n": len(v), "p50": _pct(v, 0.5), "p99": _pct(v, 0.99)}
                              for k, v in latencies.items()}}}


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("index", help="index directory written by `itmatch index`")
    p.add_argument("--requests", type=int, default=2000, help="requests to send (default 2000)")
    p.add_argument("--concurrency", type=int, default=32, help="concurrent clients (default 32)")
    p.add_argument("--max-seconds", type=float, default=300, help="stop sending after this long (default 300)")
    p.add_argument("--seed", type=int, default=0, help="seed of the request mix")
    p.add_argument("--json", help="also write the figures to this JSON file")
    p.add_argument("--captions", help="the server's caption collection (one a line): 10%% of the requests become "
                                      "photo uploads ranked over it, in place of text searches")
    p.add_argument("--ensemble", help="a second index of the same photos: the server ranks by both models' mean")
    args = p.parse_args(argv)
    if not 1 <= args.requests <= 100_000 or not 1 <= args.concurrency <= 256:
        p.error("--requests must be in 1..100000 and --concurrency in 1..256")

    port = _free_port()
    base = f"http://127.0.0.1:{port}"
    env = {**os.environ, "PYTHONUNBUFFERED": "1"}
    server = subprocess.Popen([sys.executable, "-m", "itmatch.cli", "serve", args.index, "--host", "127.0.0.1",
                               "--port", str(port), "--log-level", "warning",
                               *(["--captions", args.captions] if args.captions else []),
                               *(["--ensemble", args.ensemble] if args.ensemble else [])], env=env)
    try:
        deadline = time.monotonic() + 120
        while True:
            if server.poll() is not None:
                print(f"the server exited with code {server.returncode}", file=sys.stderr)
                return 1
            try:
                health = httpx.get(base + "/health", timeout=2).json()
                break
            except httpx.HTTPError:
                if time.monotonic() > deadline:
                    print("the server did not answer /health within 120 s", file=sys.stderr)
                    return 1
                time.sleep(0.5)
        manifest = json.loads((Path(args.index) / "manifest.json").read_text())
        ids = [public_id(e["id"]) for e in manifest["images"]]  # the names as the API knows them
        root = Path(manifest["images_root"])
        uploads = ([(root / e["id"]).read_bytes() for e in manifest["images"][:50]]  # (read once, before the clock)
                   if args.captions else None)
        # warm-up at full concurrency, so that the server's thread pool and allocator arenas have grown
        # before the "before" RSS is read (the difference then shows growth under load, not start-up)
        asyncio.run(_run(base, ids, min(200, args.requests), args.concurrency, time.monotonic() + 90, 1, uploads,
                         health["explain"]))
        rss_before, cpu_before = _rss_mb(server.pid), _cpu_seconds(server.pid)
        result = asyncio.run(_run(base, ids, args.requests, args.concurrency,
                                  time.monotonic() + args.max_seconds, args.seed, uploads, health["explain"]))
        # CPU time per request: what the load costs the server, whatever else shares the machine
        cpu = _cpu_seconds(server.pid) - cpu_before
        result.update(rss_mb_before=round(rss_before, 1), rss_mb_after=round(_rss_mb(server.pid), 1),
                      server_cpu_ms_per_request=round(1000 * cpu / max(1, result["requests"]), 2),
                      load_average_1min=os.getloadavg()[0], images=health["images"],
                      model=health.get("models", health["model"]), captions=args.captions,
                      cpus=os.cpu_count())
        metrics = httpx.get(base + "/metrics", timeout=10).json()
        result["server_p50_ms_search"] = metrics["routes"].get("GET /api/search", {}).get("latency_ms", {}).get("p50")
    finally:
        server.send_signal(signal.SIGINT)
        try:
            server.wait(timeout=20)
        except subprocess.TimeoutExpired:
            server.kill()
    print(json.dumps(result, indent=2))
    if args.json:
        Path(args.json).write_text(json.dumps(result, indent=2) + "\n")
    return 0 if result["errors"] == 0 and result["requests"] == args.requests else 1


if __name__ == "__main__":
    sys.exit(main())
