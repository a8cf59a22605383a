"""Throughput and latency of `jaxfold serve`: the folded artifact vs the original one.

Both artifacts (random weights with randomized LayerNorm γ/β, the same for both)
are served at once by two `jaxfold serve --warmup` subprocesses on 127.0.0.1
(every padded bucket compiled before the first request); the load generator
(`jaxfold.serving.run_load`: N keep-alive HTTP/1.1 clients, one request in
flight each) then drives one server at a time, alternating folded/original
every round at each concurrency level.  Every answer must be 200 (the server
answers 500 rather than return non-finite outputs) and the two servers' answers
to a probe must agree.

Per (variant, concurrency): throughput = answered requests / wall time (median
over rounds); p50/p99 = latency percentiles over all rounds' requests (send to
last byte, as a client sees it).  The client shares the machine's cores with the
server, as it would on a single host.

    python benchmarks/serve_throughput.py                       # gpt2, seq <= 32
    python benchmarks/serve_throughput.py --model gpt2-tiny --requests 256 --rounds 3
"""

from __future__ import annotations

import argparse
import base64
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
import types
import urllib.request

import _common as C
import numpy as np

import jaxfold
from jaxfold import serving
from models import serving_meta as model_meta


def _start_server(artifact: str, args) -> tuple[subprocess.Popen, str]:
  cmd = [sys.executable, "-m", "jaxfold.cli", "--quiet", "serve", artifact, "--port", "0",
         "--max-batch", str(args.max_batch), "--max-seq", str(args.seq), "--max-queue", "4096",
         "--max-wait-ms", str(args.max_wait_ms), "--warmup"]
  env = {**os.environ, "PYTHONPATH": C.ROOT + os.pathsep + os.environ.get("PYTHONPATH", "")}
  log = artifact + ".log"         # a file, not a pipe: an unread pipe would block the server
  with open(log, "w") as err:
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=err, text=True, env=env,
                            cwd=C.ROOT)
  return proc, log


def _wait_ready(proc: subprocess.Popen, log: str, timeout: float = 900) -> str:
  line = proc.stdout.readline()       # printed after --warmup compiled every bucket
  if not line.startswith("listening on "):
    raise SystemExit(f"server did not start: {line!r}\n{open(log).read()[-3000:]}")
  url = line.split()[-1]
  deadline = time.monotonic() + timeout
  while True:
    try:
      with urllib.request.urlopen(url + "/health", timeout=10) as r:
        json.loads(r.read())
      return url
    except OSError:
      if time.monotonic() > deadline or proc.poll() is not None:
        raise SystemExit(f"server at {url} not healthy") from None
      time.sleep(0.1)


def _get(url: str) -> dict:
  with urllib.request.urlopen(url, timeout=30) as r:
    return json.loads(r.read())


def _payloads(n: int, seq: int, vocab: int, seed: int, encoding: str) -> list:
  """Single-row requests of random length in [seq/2, seq] (two sequence buckets)."""
  rng = np.random.default_rng(seed)
  return [{"inputs": rng.integers(0, vocab, (1, int(rng.integers(max(1, seq // 2), seq + 1))))
           .tolist(), "encoding": encoding} for _ in range(n)]


def _decode(body: dict) -> np.ndarray:
  if body.get("encoding") == "base64":
    return np.frombuffer(base64.b64decode(body["outputs"]), "<" + np.dtype(body["dtype"]).str[1:]
                         ).reshape(body["shape"]).astype(np.float64)
  return np.asarray(body["outputs"], np.float64)


def main(argv=None) -> int:
  p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  p.add_argument("--model", default="gpt2")
  p.add_argument("--seq", type=int, default=32, help="longest request; lengths in [seq/2, seq]")
  p.add_argument("--requests", type=int, default=128, help="requests per measurement")
  p.add_argument("--concurrency", default="1,16,64", help="client counts, comma-separated")
  p.add_argument("--rounds", type=int, default=2, help="alternating folded/original rounds")
  p.add_argument("--max-batch", type=int, default=8)
  p.add_argument("--json-outputs", action="store_true",
                 help="outputs as JSON numbers (default: base64 of the raw float32 bytes; a "
                      "gpt2 answer is 1.6 M logits, ~30 MB of JSON text)")
  p.add_argument("--max-wait-ms", type=float, default=2.0)
  p.add_argument("--seed", type=int, default=0)
  p.add_argument("--out", default=os.path.join(C.RESULTS, "serve_cpu.md"))
  p.add_argument("--timeout", type=float, default=600, help="seconds per measurement, at most")
  args = p.parse_args(argv)
  levels = [int(x) for x in args.concurrency.split(",") if x.strip()]
  encoding = "json" if args.json_outputs else "base64"

  import models
  spec = models.get(args.model)
  limit = C.max_positions(spec)
  if limit is not None and args.seq > limit:
    raise SystemExit(f"--seq {args.seq} is beyond {spec.name}'s {limit} positions")
  vocab = int(spec.config.vocab_size)
  C.log(f"{spec.name}: random weights, folding and exporting both artifacts")
  params = C.random_params(spec, 2, args.seq, args.seed)
  apply = spec.apply_fn()
  example = spec.example_inputs(2, args.seq)
  folded = jaxfold.fold(params, apply, *example)
  meta = model_meta(spec)
  tmp = tempfile.mkdtemp(prefix="jaxfold-serve-bench-")
  arts = {}
  for name, f in [("original", types.SimpleNamespace(params=params, apply_fn=apply)),
                  ("folded", folded)]:
    arts[name] = os.path.join(tmp, f"{name}.jaxexport")
    with open(arts[name], "wb") as fh:
      fh.write(jaxfold.export(f, *example, meta={**meta, "folded": name == "folded"}))
  del params, folded

  C.log("starting both servers (--warmup compiles every bucket) ...")
  procs = {name: _start_server(path, args) for name, path in arts.items()}
  try:
    urls = {name: _wait_ready(proc, log) for name, (proc, log) in procs.items()}
    health = {name: _get(u + "/health") for name, u in urls.items()}
    # the two servers agree (and answer finite numbers) on a probe
    probe = _payloads(4, args.seq, vocab, args.seed + 1, encoding)
    answers = {}
    for name, u in urls.items():
      res = serving.load_test(u + "/predict", probe, concurrency=1, timeout=args.timeout)
      if res.ok != len(probe):
        raise SystemExit(f"{name} server failed the probe: {res.status} {res.body[:1]}")
      answers[name] = [_decode(b) for b in res.body]
    err = max(float(np.max(np.abs(a - b)) / np.max(np.abs(a)))
              for a, b in zip(answers["original"], answers["folded"]))
    C.log(f"probe: folded vs original max relative error {err:.1e}")
    if not err < 1e-4:
      raise SystemExit(f"folded and original servers disagree (relative error {err:.1e})")

    results = {}
    for level in levels:
      payloads = _payloads(args.requests, args.seq, vocab, args.seed + level, encoding)
      for u in urls.values():   # warm the connections' path (buckets are compiled)
        serving.load_test(u + "/predict", payloads[:2 * level], concurrency=level,
                          timeout=args.timeout, keep_bodies=False)
      for r in range(args.rounds):
        order = ["original", "folded"] if r % 2 == 0 else ["folded", "original"]
        for name in order:
          res = serving.load_test(urls[name] + "/predict", payloads, concurrency=level,
                                  timeout=args.timeout, keep_bodies=False)
          if res.ok != len(payloads):
            bad = [(s, b) for s, b in zip(res.status, res.body) if s != 200][:3]
            raise SystemExit(f"{name} @ {level} clients: {len(payloads) - res.ok} requests "
                             f"failed, e.g. {bad} {res.errors[:3]}")
          rec = results.setdefault((name, level), {"tput": [], "lat": []})
          rec["tput"].append(res.throughput)
          rec["lat"].extend(l for l, s in zip(res.latency, res.status) if s == 200)
          C.log(f"  round {r + 1}: {name:8s} {level:3d} clients: {res.throughput:7.1f} req/s")
    metrics = {name: _get(u + "/metrics") for name, u in urls.items()}
  finally:
    for proc, _ in procs.values():
      if proc.poll() is None:
        proc.terminate()
    codes = {}
    for name, (proc, _) in procs.items():
      try:
        codes[name] = proc.wait(timeout=60)
      except subprocess.TimeoutExpired:
        proc.kill()
        codes[name] = "killed"
  C.log(f"servers exited with {codes} after SIGTERM")

  rows = []
  for level in levels:
    base = None
    for name in ("original", "folded"):
      rec = results[(name, level)]
      lat = sorted(rec["lat"])
      tput = statistics.median(rec["tput"])
      row = {"variant": name, "clients": level, "throughput (req/s)": f"{tput:.1f}",
             "p50 (ms)": f"{1e3 * lat[len(lat) // 2]:.1f}",
             "p99 (ms)": f"{1e3 * lat[min(len(lat) - 1, int(0.99 * len(lat)))]:.1f}",
             "rounds": len(rec["tput"]), "requests": len(lat)}
      if name == "original":
        base = tput
      else:
        row["folded/original throughput"] = f"{tput / base:.3f}"
      rows.append(row)
      rec.update(tput_med=tput, p50=1e3 * lat[len(lat) // 2],
                 p99=1e3 * lat[min(len(lat) - 1, int(0.99 * len(lat)))])
  cols = ["variant", "clients", "throughput (req/s)", "p50 (ms)", "p99 (ms)",
          "folded/original throughput", "rounds", "requests"]
  table = C.markdown_table(rows, cols)
  print("\n".join(table))
  buckets = health["folded"]["buckets"]
  lines = C.header(f"jaxfold serve: {spec.name}, folded vs original artifact", sys.argv[1:] if
                   argv is None else argv)
  lines += [f"- requests: one row each, length uniform in [{max(1, args.seq // 2)}, {args.seq}], "
            f"{args.requests} per measurement, {args.rounds} rounds alternating the variants",
            f"- server: `jaxfold serve --max-batch {args.max_batch} --max-seq {args.seq} "
            f"--max-wait-ms {args.max_wait_ms:g} --warmup`; batch buckets "
            f"{buckets['batch_buckets']}, sequence buckets {buckets['seq_buckets']}",
            f"- programs compiled: folded {len(metrics['folded']['programs_compiled'])}, original "
            f"{len(metrics['original']['programs_compiled'])} (at most {buckets['max_programs']}); "
            f"mean requests per batch over the run: folded "
            f"{metrics['folded']['mean_requests_per_batch']}, original "
            f"{metrics['original']['mean_requests_per_batch']}",
            f"- outputs encoded as {encoding} "
            f"({'JSON numbers' if encoding == 'json' else 'raw float32 bytes'}); the client "
            "does not parse the 200 answers while measuring",
            f"- probe answers, folded vs original: max relative error {err:.1e}",
            "- client (asyncio, same machine) and server share the cores", ""]
  lines += table
  png = os.path.splitext(args.out)[0] + ".png"
  lines += ["", f"![throughput and latency]({os.path.basename(png)})"]
  C.write_markdown(args.out, lines)
  _plot(png, spec.name, levels, results)
  return 0


def _plot(path: str, model: str, levels: list, results: dict) -> None:
  try:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
  except ImportError:
    C.log("matplotlib not installed: no PNG written")
    return
  fig, (a, b) = plt.subplots(1, 2, figsize=(10, 4))
  colors = {"original": "#4c72b0", "folded": "#dd8452"}
  for name in ("original", "folded"):
    a.plot(levels, [results[(name, l)]["tput_med"] for l in levels], "o-", color=colors[name],
           label=name)
    b.plot(levels, [results[(name, l)]["p50"] for l in levels], "o-", color=colors[name],
           label=f"{name} p50")
    b.plot(levels, [results[(name, l)]["p99"] for l in levels], "s--", color=colors[name],
           label=f"{name} p99")
  for ax in (a, b):
    ax.set_xscale("log", base=2)
    ax.set_xticks(levels)
    ax.set_xticklabels([str(l) for l in levels])
    ax.set_xlabel("concurrent clients")
    ax.legend(fontsize=8)
  a.set_ylabel("throughput (requests/s)")
  b.set_ylabel("latency (ms)")
  b.set_yscale("log")
  fig.suptitle(f"jaxfold serve, {model}: folded vs original artifact", fontsize=10)
  fig.tight_layout()
  fig.savefig(path, dpi=120)
  plt.close(fig)
  C.log(f"wrote {path}")


if __name__ == "__main__":
  sys.exit(main())
