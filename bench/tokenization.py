"""Tokenization throughput per core: ``goodput stage`` against ``tokenizers``' ``encode_batch``, and the
stage's scaling from 1 to N tokenizer processes, side by side in one run; and the fan-out's merge overhead.

    python bench/tokenization.py                     # 300 MB of JSONL in 16 files, a BPE of 8192 tokens
    python bench/tokenization.py --mb 20             # a quick look

What it does, in a temporary directory (``--work``):
  1. writes ``--mb`` MB of JSONL (``--files`` files, documents cut from this Python's standard library
     sources, each with a distinct line so no two are alike);
  2. trains one byte-level BPE (``--vocab``) on the first files with ``tokenizers`` and saves it as a
     tokenizer.json, which every side uses (training is not what is compared);
  3. baseline: one process reads each file line by line, ``json.loads`` each record, calls
     ``Tokenizer.encode_batch`` on batches of documents (``tokenizers`` spreads each batch over its own
     thread pool, one thread per core, as it does by default), appends the EOS and writes the ids as uint16;
  4. ``stage_dataset`` of the same directory with that tokenizer.json, with 1, 2, ... N tokenizer processes
     (``--workers``, default: every core; their malloc is ``$GOODPUT_TOKENIZE_MALLOC``, default auto:
     mimalloc where installed): copy into raw/, tokenize, write shards and the manifest;
  5. the fan-out: ``plan_stage`` + ``stage_partition`` for each of ``--parts`` partitions (one after the
     other here; in a pipeline they run in parallel pods) + ``merge_stage``; the merge overhead is the plan
     and merge time against the whole;
  6. prints, for each, MB/s of source text, the cores it kept busy (CPU seconds of its threads and child
     processes per wall second), and MB per CPU second: the throughput per core. ``encode_batch`` already
     uses every core, so the comparison that means something is per core; the stage's scaling is its MB/s
     with N processes over its MB/s with one (N x is linear). Both sides must produce the same tokens.

Timings are wall clock; run it on a quiet machine - other work on the cores changes every side. Each line
says how many cores other processes took meanwhile (from /proc/stat): a figure is only worth its
"other processes ~0.0 cores".
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import shutil
import sys
import sysconfig
import tempfile
import time
from pathlib import Path

MB = 1024 * 1024


def cpu_s() -> float:
    """CPU seconds (user + system) of this process's threads and its waited-for child processes."""
    return sum(r.ru_utime + r.ru_stime for r in (resource.getrusage(resource.RUSAGE_SELF),
                                                 resource.getrusage(resource.RUSAGE_CHILDREN)))


def machine_busy_s() -> float:
    """CPU seconds all processes of the machine have been busy (Linux /proc/stat; 0 elsewhere)."""
    try:
        fields = open("/proc/stat").readline().split()[1:9]
    except OSError:
        return 0.0
    user, nice, system, _idle, _iowait, irq, softirq, steal = map(int, fields)
    return (user + nice + system + irq + softirq + steal) / os.sysconf("SC_CLK_TCK")


class Meter:
    """Wall, own CPU, and the CPU other processes of the machine took meanwhile (a shared machine's noise)."""

    def __enter__(self) -> "Meter":
        self.t0, self.c0, self.m0 = time.perf_counter(), cpu_s(), machine_busy_s()
        return self

    def __exit__(self, *exc) -> None:
        self.wall, self.cpu = time.perf_counter() - self.t0, cpu_s() - self.c0
        self.others = max(0.0, machine_busy_s() - self.m0 - self.cpu)

    def __str__(self) -> str:
        return (f"CPU {self.cpu:.2f} s = {self.cpu / self.wall:.2f} cores busy; other processes "
                f"{self.others / self.wall:.2f} cores")


def per_core(mb: float, meter: Meter) -> str:
    return f"{meter.cpu / meter.wall:.2f} cores busy, {mb / meter.cpu:.2f} MB per CPU s"


def write_corpus(root: Path, total_mb: float, files: int, doc_chars: int = 2000) -> int:
    """JSONL files of about total_mb MB; returns the bytes written."""
    sources = sorted(Path(sysconfig.get_paths()["stdlib"]).glob("*.py"))
    text = "".join(p.read_text(errors="replace") for p in sources[:80])
    root.mkdir(parents=True)
    per_file = int(total_mb * MB / files)
    written, n = 0, 0
    for f in range(files):
        with open(root / f"part-{f:05d}.jsonl", "w") as out:
            size = 0
            while size < per_file:
                start = (n * 7919) % max(1, len(text) - doc_chars)
                line = json.dumps({"id": n, "text": f"document {n}\n" + text[start:start + doc_chars]}) + "\n"
                out.write(line)
                size += len(line)
                n += 1
        written += size
    return written


def train_tokenizer(root: Path, vocab: int, out: Path) -> Path:
    from components.stage.tokenizer import train_bpe

    docs = (json.loads(line)["text"] for p in sorted(root.glob("*.jsonl"))[:2] for line in open(p))
    train_bpe(docs, vocab).save(str(out))
    return out


def baseline(root: Path, tokenizer_file: Path, out: Path, batch: int = 1000) -> tuple[float, int]:
    """The plain loop: (seconds, tokens)."""
    import numpy as np
    from tokenizers import Tokenizer

    tok = Tokenizer.from_file(str(tokenizer_file))
    eos = tok.token_to_id("<|endoftext|>")
    tokens = 0
    t0 = time.perf_counter()
    with open(out, "wb") as f:
        for path in sorted(root.glob("*.jsonl")):
            docs = []
            with open(path) as src:
                for line in src:
                    docs.append(json.loads(line)["text"])
                    if len(docs) == batch:
                        tokens += _write(f, tok.encode_batch(docs, add_special_tokens=False), eos, np)
                        docs = []
            if docs:
                tokens += _write(f, tok.encode_batch(docs, add_special_tokens=False), eos, np)
    return time.perf_counter() - t0, tokens


def _write(f, encodings, eos: int, np) -> int:
    ids = np.concatenate([np.asarray(e.ids + [eos], dtype=np.uint16) for e in encodings])
    ids.tofile(f)
    return len(ids)


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--mb", type=float, default=300, help="MB of JSONL to generate (default 300)")
    p.add_argument("--files", type=int, default=16, help="files to spread them over (default 16)")
    p.add_argument("--vocab", type=int, default=8192, help="BPE vocabulary (default 8192)")
    p.add_argument("--workers", type=int, default=None, help="tokenizer processes of the stage (default: all cores)")
    p.add_argument("--parts", type=int, default=2, help="fan-out partitions (default 2)")
    p.add_argument("--work", type=Path, default=None, help="scratch directory (default: a temporary one)")
    args = p.parse_args(argv)
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
    from components.stage.dataset import stage_dataset
    from components.stage.fanout import merge_stage, plan_stage, stage_partition
    from components.stage.tokens import worker_allocator

    work = Path(tempfile.mkdtemp(prefix="bench-tokenize-", dir=args.work))
    try:
        src = work / "src"
        nbytes = write_corpus(src, args.mb, args.files)
        mb = nbytes / MB
        tok_file = train_tokenizer(src, args.vocab, work / "tokenizer.json")
        print(f"corpus: {mb:.1f} MB of JSONL in {args.files} files; BPE of {args.vocab} tokens; "
              f"{os.cpu_count()} cores", flush=True)

        with Meter() as base:
            base_s, base_tokens = baseline(src, tok_file, work / "baseline.bin")
        print(f"encode_batch (one process, tokenizers' thread pool): {mb / base_s:6.2f} MB/s, "
              f"{per_core(mb, base)}; {base_tokens:,} tokens; {base}", flush=True)

        pack = max(MB, int(nbytes / (4 * args.files)) or 1)
        most = args.workers or os.cpu_count() or 1
        rates = {}
        for n in sorted({1, *range(2, most + 1)}):
            with Meter() as stage:
                r = stage_dataset(str(src), work / "fsx", "bench", f"w{n}", tokenizer=str(tok_file),
                                  val_percent=0, workers=n, pack_bytes=pack)
            rates[n] = mb / stage.wall
            tokens = r.train_tokens + r.val_tokens
            print(f"goodput stage, {n} process{'es' if n > 1 else ''} (copy + tokenize; malloc "
                  f"{worker_allocator() or 'glibc'}): {rates[n]:6.2f} MB/s, {per_core(mb, stage)}, scaling "
                  f"{rates[n] / rates[1]:.2f}x of 1 process; {stage}", flush=True)
            if tokens != base_tokens:
                raise SystemExit(f"token counts differ: stage {tokens:,}, baseline {base_tokens:,}")
            if n == most:
                per_core_ratio = (mb / stage.cpu) / (mb / base.cpu)

        t0 = time.perf_counter()
        parts = plan_stage(str(src), work / "fsx", "bench", "fanout", tokenizer=str(tok_file), val_percent=0,
                           stage_parallelism=args.parts, partition_min_bytes=1, pack_bytes=pack)
        plan_s = time.perf_counter() - t0
        part_s = []
        for i in parts:
            t1 = time.perf_counter()
            stage_partition(work / "fsx", "bench", "fanout", i, workers=args.workers)
            part_s.append(time.perf_counter() - t1)
        t1 = time.perf_counter()
        merged = merge_stage(work / "fsx", "bench", "fanout")
        merge_s = time.perf_counter() - t1
        assert merged.train_tokens == r.train_tokens
        # In a pipeline the partitions run side by side: the wall is plan + the slowest partition + merge.
        wall = plan_s + max(part_s) + merge_s
        print(f"fan-out ({len(parts)} partitions, run one after the other here): plan {plan_s:.2f} s, partitions "
              f"{', '.join(f'{s:.2f}' for s in part_s)} s, merge {merge_s:.2f} s; plan + merge = "
              f"{(plan_s + merge_s) / wall:.1%} of a parallel run's wall ({wall:.2f} s)")
        print(f"per core: goodput stage ({most} processes) / encode_batch = {per_core_ratio:.2f}x; scaling 1 -> "
              f"{most} processes: {rates[most] / rates[1]:.2f}x (linear: {most}x)")
    finally:
        shutil.rmtree(work, ignore_errors=True)


if __name__ == "__main__":
    main()
