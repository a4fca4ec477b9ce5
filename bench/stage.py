"""Staging throughput: ``goodput stage`` against ``aws s3 sync`` and the endpoint's own ceiling, in one run.

Setup (awscli is a bench-only tool, not a dependency of the package):

    python -m pip install -e '.[test]' awscli

Run (about 13 minutes on 2 cores, 2.5 of them uploading; ~4 GB of disk under --work, ~3 GB of memory for moto):

    python bench/stage.py                       # 10,000 x 4 KB objects, 4 x 256 MB objects
    python bench/stage.py --small 2000 --large 2 --large-mb 64     # a quick look

What it does, against one moto S3 server started here as a separate process on 127.0.0.1:
  1. uploads the small objects (``small/``) and the large ones (``large/``, multipart, printable text);
  2. ceiling: concurrent GETs of the small objects, bodies read and dropped, no disk writes, with the same
     client settings as ``goodput stage``: a few thread counts on the first 2,000 keys, then every key
     with the best count, before and after our run (the higher, stricter figure is kept);
  3. ``aws s3 sync`` of each prefix into a fresh directory, then ``goodput stage`` of the same prefix (a
     subprocess too, so both pay their start-up), both with the same number of concurrent requests (the
     ceiling's best thread count; ``s3.max_concurrent_requests`` for aws), then both again on the
     unchanged prefix, timed the same way (wall time of the whole command);
  4. the listing alone (what any re-stage must at least do: the incremental check needs every ETag);
  5. prints each figure and its ratio to the baselines measured above, with the goals:
     small objects >= 95% of the ceiling (and above aws s3 sync), large objects >= 1x aws s3 sync,
     unchanged re-stage <= 5% of the first stage.

Beside each run it prints the moto server's CPU time per object (from /proc) and how busy it was: the
server is one Python process (about one core for small requests, the GIL), so near 100% busy the
endpoint is the bottleneck; on a small machine the client's CPU competes with it. The listing is server
work the GET-only ceiling leaves out (moto: ~0.5 ms of CPU per key against ~7 ms per GET), so the table
also prints the ceiling of a whole stage: every GET at the ceiling's rate plus the listing alone.

Peak memory (``--memory``, no S3, about 5 minutes and 7 GB of disk under --work): ``goodput stage`` of a
``--jsonl-gb`` GB JSONL file (4 kB documents, the byte vocabulary) and of a ``--doc-mb`` MB single document
(one JSONL line, a byte-level BPE of 400 tokens made here), each generated in --work from a repeated block and
staged in a fresh process with one tokenizer process (a single file is one job: the stage's own process
tokenizes it), and of a Parquet file of ``--parquet-mb`` MB of 1 MB values and one value of ``--parquet-value-mb``
MB (the byte vocabulary); prints the process's peak resident memory (``VmHWM``) before and after, with
``batch_bytes``:

    python bench/stage.py --memory                         # 2 GB file, 200 MB document, batch_bytes 4 MiB
    python bench/stage.py --memory --batch-bytes 1048576

``goodput stage`` also builds the dataset (reads every file, hashes it, writes token shards), which
``aws s3 sync`` does not do: its list+transfer time (list, download, verify, rename; listing overlaps the
downloads as in ``aws s3 sync``) is what the goals compare, and the end-to-end time including the build
is printed beside it.
"""

from __future__ import annotations

import argparse
import concurrent.futures as cf
import json
import os
import shutil
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

CREDENTIALS = {"AWS_ACCESS_KEY_ID": "bench", "AWS_SECRET_ACCESS_KEY": "bench", "AWS_DEFAULT_REGION": "us-east-1"}
BUCKET = "bench"


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def start_moto(port: int, log: Path) -> subprocess.Popen:
    proc = subprocess.Popen([sys.executable, "-m", "moto.server", "-H", "127.0.0.1", "-p", str(port)],
                            stdout=open(log, "wb"), stderr=subprocess.STDOUT)
    deadline = time.monotonic() + 60
    while time.monotonic() < deadline:
        try:
            socket.create_connection(("127.0.0.1", port), timeout=1).close()
            return proc
        except OSError:
            time.sleep(0.2)
    proc.kill()
    raise SystemExit(f"moto server did not start; see {log}")


def client(url: str, pool: int = 64):
    import boto3
    from botocore.config import Config

    return boto3.session.Session().client("s3", endpoint_url=url, config=Config(
        s3={"addressing_style": "path"}, max_pool_connections=pool, retries={"mode": "standard", "max_attempts": 5}))


def text_blob(rng: np.random.Generator, n: int) -> bytes:
    """Printable ASCII with newlines (a text file the dataset builder accepts)."""
    data = rng.integers(32, 127, size=n, dtype=np.uint8)
    data[rng.integers(0, n, size=max(1, n // 80))] = 10
    return data.tobytes()


def upload(url: str, small: int, small_size: int, large: int, large_mb: int, work: Path) -> None:
    from boto3.s3.transfer import TransferConfig, create_transfer_manager

    c = client(url)
    c.create_bucket(Bucket=BUCKET)
    rng = np.random.default_rng(0)
    t0 = time.monotonic()
    blobs = [text_blob(rng, small_size) for _ in range(64)]
    with cf.ThreadPoolExecutor(32) as ex:
        list(ex.map(lambda i: c.put_object(Bucket=BUCKET, Key=f"small/{i % 100:02d}/{i:06d}.txt",
                                           Body=blobs[i % 64][:-8] + f"{i:08d}".encode()), range(small)))
    print(f"uploaded {small} x {small_size} B in {time.monotonic() - t0:.1f}s", flush=True)
    t0 = time.monotonic()
    cfg = TransferConfig(multipart_threshold=8 << 20, multipart_chunksize=8 << 20, max_concurrency=8)
    with create_transfer_manager(c, cfg) as tm:
        for i in range(large):
            path = work / f"large_{i}.txt"
            with open(path, "wb") as f:
                for _ in range(large_mb // 16):
                    f.write(text_blob(rng, 16 << 20))
            tm.upload(str(path), BUCKET, f"large/part_{i}.txt").result()
            path.unlink()
    print(f"uploaded {large} x {large_mb} MB in {time.monotonic() - t0:.1f}s", flush=True)


class ServerCPU:
    """CPU seconds the moto server process used during a block (utime + stime from /proc)."""

    def __init__(self, pid: int):
        self.path, self.s, self.wall = f"/proc/{pid}/stat", 0.0, 0.0

    def _now(self) -> float:
        fields = Path(self.path).read_text().rsplit(")", 1)[1].split()
        return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")

    def __enter__(self) -> "ServerCPU":
        self.t0, self.c0 = time.monotonic(), self._now()
        return self

    def __exit__(self, *exc) -> None:
        self.s, self.wall = self._now() - self.c0, time.monotonic() - self.t0

    def per(self, n: int) -> str:
        return f"moto {self.s / n * 1e3:.2f} ms CPU/object, {self.s / self.wall:.0%} busy"


def list_keys(c, prefix: str) -> list[str]:
    return [o["Key"] for page in c.get_paginator("list_objects_v2").paginate(Bucket=BUCKET, Prefix=prefix)
            for o in page.get("Contents", [])]


def ceiling(url: str, keys: list[str], threads: int, moto: int) -> float:
    """Objects/s of concurrent GETs (bodies read and dropped), with the same client settings as ``goodput
    stage`` (so the ceiling is the endpoint's, not a slower client's)."""
    from components.s3 import s3_client

    c = s3_client(url, max_pool_connections=threads + 4)
    with ServerCPU(moto) as cpu, cf.ThreadPoolExecutor(threads) as ex:
        list(ex.map(lambda k: c.get_object(Bucket=BUCKET, Key=k)["Body"].read(), keys))
    rate = len(keys) / cpu.wall
    print(f"  ceiling, {len(keys)} GETs with {threads} threads: {rate:.0f}/s ({cpu.per(len(keys))})", flush=True)
    return rate


def listing(url: str, prefix: str, moto: int) -> float:
    """Seconds to list the prefix once (the floor of any incremental re-stage)."""
    from components.s3 import s3_client

    c = s3_client(url)
    with ServerCPU(moto) as cpu:
        n = len(list_keys(c, prefix))
    print(f"  listing alone: {cpu.wall:.2f}s ({cpu.per(n)})", flush=True)
    return cpu.wall


def aws_sync(url: str, prefix: str, dest: Path, concurrency: int, moto: int) -> float:
    # awscli reads its transfer concurrency from the config file only.
    config = dest.parent / f"aws-config-{concurrency}"
    config.write_text(f"[default]\ns3 =\n  max_concurrent_requests = {concurrency}\n")
    with ServerCPU(moto) as cpu:
        subprocess.run(["aws", "s3", "sync", f"s3://{BUCKET}/{prefix}", str(dest), "--endpoint-url", url,
                        "--only-show-errors"], check=True, env={**os.environ, "AWS_CONFIG_FILE": str(config)})
    print(f"  aws s3 sync ({concurrency} concurrent requests): {cpu.wall:.1f}s ({cpu.per(count_files(dest))})",
          flush=True)
    return cpu.wall


def goodput_stage(url: str, prefix: str, fsx: Path, name: str, concurrency: int, moto: int) -> tuple[float, dict]:
    cmd = [sys.executable, "-c", "from pipelines.cli import main; main()", "stage", f"s3://{BUCKET}/{prefix}",
           "--fsx-root", str(fsx), "--name", name, "--version", "1", "--endpoint-url", url,
           "--concurrency", str(concurrency), "--quiet", "--json"]
    with ServerCPU(moto) as cpu:
        out = subprocess.run(cmd, check=True, capture_output=True, text=True)
    r = json.loads(out.stdout.strip().splitlines()[-1])
    print(f"  goodput stage ({concurrency} concurrent requests): {cpu.wall:.1f}s (list+transfer "
          f"{r['list_s'] + r['transfer_s']:.1f}s, build {r['build_s']:.1f}s; {cpu.per(r['objects'])})", flush=True)
    return cpu.wall, r


def count_files(path: Path) -> int:
    return sum(len(f) for _, _, f in os.walk(path))


PEAK = r"""
import json, re, sys, time
def peak_mb():
    # VmHWM, not ru_maxrss: Linux carries ru_maxrss over from the parent across fork and exec.
    return int(re.search(r"VmHWM:\s+(\d+) kB", open("/proc/self/status").read()).group(1)) / 1024
from components.stage.dataset import stage_dataset
import tokenizers, numpy, pyarrow.parquet   # what the stage imports, before the baseline
before = peak_mb()
src, fsx, tok, batch = sys.argv[1:5]
t0 = time.monotonic()
r = stage_dataset(src, fsx, "m", "1", tokenizer=tok, val_percent=0, batch_bytes=int(batch))
print(json.dumps({"before_mb": before, "peak_mb": peak_mb(), "wall_s": time.monotonic() - t0,
                  "tokens": r.train_tokens, "workers": 1}))
"""
# JSON-escaped text (non-ASCII as \u escapes, quotes), written as is into the JSONL files.
BLOCK = (r"a long document is read and tokenized in pieces cut at spaces, so the tokenizer sees whole words: "
         r"caf\u00e9 na\u00efve \u6771\u4eac \"quoted\" ")


def write_parquet(path: Path, mb: float, value_mb: float) -> None:
    """``mb`` MB of distinct 1 MB values, then one of ``value_mb`` MB, uncompressed, in row groups of 64 values
    and pages of about one value (a writer checks its page size bound every write_batch_size values)."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    text = json.loads(f'"{BLOCK}"')
    value = text * (1024 * 1024 // len(text.encode()))
    with pq.ParquetWriter(path, pa.schema([("text", pa.string())]), compression="none", write_batch_size=1) as w:
        for g in range(int(mb) // 64):
            w.write_table(pa.table({"text": [f"{g}.{i} {value}" for i in range(64)]}))
        w.write_table(pa.table({"text": [text * int(value_mb * 1024 * 1024 // len(text.encode()))]}))


def memory(args) -> None:
    """Peak memory of a stage of a large file and of a long document (see the module's docstring)."""
    from tokenizers import Tokenizer, models, pre_tokenizers, trainers

    work = Path(args.work or tempfile.mkdtemp(prefix="bench-stage-memory-"))
    work.mkdir(parents=True, exist_ok=True)
    root = Path(__file__).resolve().parent.parent
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.train_from_iterator([json.loads(f'"{BLOCK}"') * 20], trainers.BpeTrainer(
        vocab_size=400, special_tokens=["<|endoftext|>"], initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False))
    tok.save(str(work / "tokenizer.json"))
    try:
        cases = []
        big = work / "big" / "corpus.jsonl"
        big.parent.mkdir(exist_ok=True)
        line = f'{{"text": "{BLOCK * (4000 // len(BLOCK))}"}}\n'
        block = (line * 256).encode()
        with open(big, "wb") as f:
            for _ in range(int(args.jsonl_gb * 1024 ** 3) // len(block)):
                f.write(block)
        cases.append((f"{big.stat().st_size / 1024 ** 3:.2f} GB JSONL file, 4 kB documents, bytes", big.parent,
                      "bytes"))
        doc = work / "doc" / "one.jsonl"
        doc.parent.mkdir(exist_ok=True)
        with open(doc, "wb") as f:
            f.write(b'{"id": 1, "text": "')
            piece = (BLOCK * 1000).encode()
            for _ in range(int(args.doc_mb * 1024 * 1024) // len(piece)):
                f.write(piece)
            f.write(b'"}\n')
        cases.append((f"{doc.stat().st_size / 1024 ** 2:.0f} MB single document, BPE 400", doc.parent,
                      str(work / "tokenizer.json")))
        table = work / "parquet" / "corpus.parquet"
        table.parent.mkdir(exist_ok=True)
        write_parquet(table, args.parquet_mb, args.parquet_value_mb)
        cases.append((f"{table.stat().st_size / 1024 ** 2:.0f} MB Parquet file, 1 MB values and one of "
                      f"{args.parquet_value_mb:.0f} MB, bytes", table.parent, "bytes"))
        for name, src, tokenizer in cases:
            out = subprocess.run([sys.executable, "-c", PEAK, str(src), str(work / f"fsx-{src.name}"), tokenizer,
                                  str(args.batch_bytes)], capture_output=True, text=True, cwd=root,
                                 env={**os.environ, "PYTHONPATH": str(root)})
            if out.returncode:
                raise SystemExit(out.stderr[-3000:])
            m = json.loads(out.stdout.splitlines()[-1])
            print(f"{name}: peak {m['peak_mb']:.0f} MB (after imports {m['before_mb']:.0f} MB: the stage "
                  f"added {m['peak_mb'] - m['before_mb']:.0f} MB) with batch_bytes {args.batch_bytes:,}; "
                  f"{m['tokens']:,} tokens in {m['wall_s']:.0f} s", flush=True)
            shutil.rmtree(work / f"fsx-{src.name}", ignore_errors=True)
    finally:
        if not args.work:
            shutil.rmtree(work, ignore_errors=True)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--small", type=int, default=10_000, help="small objects")
    p.add_argument("--small-size", type=int, default=4096, help="bytes per small object")
    p.add_argument("--large", type=int, default=4, help="large objects")
    p.add_argument("--large-mb", type=int, default=256, help="MB per large object (multiple of 16)")
    p.add_argument("--concurrency", type=int, default=0,
                   help="concurrent requests of both tools (default: the ceiling's best thread count)")
    p.add_argument("--ceiling-threads", default="8,16,32,64", help="thread counts tried for the ceiling")
    p.add_argument("--work", type=Path, default=None, help="scratch directory (default: a temp dir)")
    p.add_argument("--memory", action="store_true", help="measure peak memory instead (see above)")
    p.add_argument("--jsonl-gb", type=float, default=2.0, help="--memory: GB of the JSONL file")
    p.add_argument("--doc-mb", type=float, default=200.0, help="--memory: MB of the single document")
    p.add_argument("--parquet-mb", type=float, default=1024.0, help="--memory: MB of 1 MB values in the Parquet file")
    p.add_argument("--parquet-value-mb", type=float, default=200.0, help="--memory: MB of its one long value")
    p.add_argument("--batch-bytes", type=int, default=4 * 1024 * 1024, help="--memory: the stage's batch_bytes")
    args = p.parse_args()
    if args.memory:
        memory(args)
        return
    if shutil.which("aws") is None:
        raise SystemExit("aws CLI not found: python -m pip install awscli")
    os.environ.update(CREDENTIALS)
    work = Path(args.work or tempfile.mkdtemp(prefix="bench-stage-"))
    work.mkdir(parents=True, exist_ok=True)
    port = free_port()
    url = f"http://127.0.0.1:{port}"
    server = start_moto(port, work / "moto.log")
    moto = server.pid
    rows = []
    try:
        upload(url, args.small, args.small_size, args.large, args.large_mb, work)
        from components.s3 import s3_client

        n = args.small
        keys = list_keys(s3_client(url), "small/")
        print("small objects", flush=True)
        sweep = {t: ceiling(url, keys[:2000], t, moto) for t in map(int, args.ceiling_threads.split(","))}
        ceil_threads = max(sweep, key=sweep.get)
        concurrency = args.concurrency or ceil_threads
        ceil_rate = ceiling(url, keys, ceil_threads, moto)
        list_s = listing(url, "small/", moto)
        aws_s = aws_sync(url, "small/", work / "aws_small", concurrency, moto)
        assert count_files(work / "aws_small") == n
        ours_s, r = goodput_stage(url, "small/", work / "fsx", "small", concurrency, moto)
        assert r["transferred"] == n, r
        # The machine is shared: measure the ceiling again after our run and keep the higher (stricter) one.
        ceil_rate = max(ceil_rate, ceiling(url, keys, ceil_threads, moto))
        aws_re_s = aws_sync(url, "small/", work / "aws_small", concurrency, moto)
        re_s, r2 = goodput_stage(url, "small/", work / "fsx", "small", concurrency, moto)
        assert r2["transferred"] == 0 and r2["skipped_unchanged"] == n and not r2["rebuilt"], r2
        xfer_rate = n / (r["list_s"] + r["transfer_s"])
        rows += [
            ("small: endpoint ceiling (GETs/s, no disk)", f"{ceil_rate:.0f}/s ({ceil_threads} threads)", "",
             f"both tools ran with {concurrency} concurrent requests"),
            ("small: ceiling incl. the listing a stage needs", f"{n / (n / ceil_rate + list_s):.0f}/s",
             f"{n / ceil_rate + list_s:.1f}s", f"goodput stage reaches {(n / ceil_rate + list_s) / (n / xfer_rate):.0%}"
             " of it"),
            ("small: aws s3 sync (files/s)", f"{n / aws_s:.0f}/s", f"{aws_s:.1f}s",
             f"{n / aws_s / ceil_rate:.0%} of ceiling"),
            ("small: goodput stage, list+transfer (files/s)", f"{xfer_rate:.0f}/s",
             f"{r['list_s'] + r['transfer_s']:.1f}s",
             f"{xfer_rate / ceil_rate:.0%} of ceiling (goal >= 95%), {xfer_rate / (n / aws_s):.2f}x aws"),
            ("small: goodput stage, end to end incl. build", f"{n / ours_s:.0f}/s", f"{ours_s:.1f}s",
             f"{(n / ours_s) / ceil_rate:.0%} of ceiling, {aws_s / ours_s:.2f}x aws"),
            ("small: listing alone (floor of any re-stage)", f"{n / list_s:.0f} keys/s", f"{list_s:.2f}s",
             f"{list_s / ours_s:.1%} of the first stage"),
            ("small: unchanged re-stage, end to end", "", f"{re_s:.2f}s",
             f"{re_s / ours_s:.1%} of the first stage (goal <= 5%); aws s3 sync re-run {aws_re_s:.2f}s = "
             f"{aws_re_s / aws_s:.1%} of its first"),
        ]

        if args.large:
            print("large objects", flush=True)
            total = args.large * args.large_mb
            aws_l = aws_sync(url, "large/", work / "aws_large", concurrency, moto)
            shutil.rmtree(work / "aws_large")     # disk: the aws copy is not needed any more
            ours_l, rl = goodput_stage(url, "large/", work / "fsx", "large", concurrency, moto)
            assert rl["transferred"] == args.large, rl
            re_l, rl2 = goodput_stage(url, "large/", work / "fsx", "large", concurrency, moto)
            assert rl2["transferred"] == 0, rl2
            xfer_l = rl["list_s"] + rl["transfer_s"]
            rows += [
                (f"large: aws s3 sync ({args.large} x {args.large_mb} MB)", f"{total / aws_l:.0f} MB/s",
                 f"{aws_l:.1f}s", ""),
                ("large: goodput stage, list+transfer", f"{total / xfer_l:.0f} MB/s", f"{xfer_l:.1f}s",
                 f"{aws_l / xfer_l:.2f}x aws (goal >= 1x)"),
                ("large: goodput stage, end to end incl. build", f"{total / ours_l:.0f} MB/s", f"{ours_l:.1f}s",
                 f"{aws_l / ours_l:.2f}x aws"),
                ("large: unchanged re-stage, end to end", "", f"{re_l:.2f}s",
                 f"{re_l / ours_l:.1%} of the first stage"),
            ]
    finally:
        server.terminate()
        server.wait()
    width = max(len(r[0]) for r in rows)
    print(f"\n{'measurement':<{width}}  {'rate':>18}  {'time':>8}  ratio")
    for name, rate, t, ratio in rows:
        print(f"{name:<{width}}  {rate:>18}  {t:>8}  {ratio}")
    if not args.work:
        shutil.rmtree(work, ignore_errors=True)


if __name__ == "__main__":
    main()
