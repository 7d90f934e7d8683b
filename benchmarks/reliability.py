"""Reliability runs of the main job: repeated long default-path runs, and SIGKILLs during checkpoint saves.

    python benchmarks/reliability.py --repeat 3          # the issue's 300-step disk-tier command, 3 times in a row
    python benchmarks/reliability.py --kills 10          # kill -9 during checkpoint saves, then --resume
    python benchmarks/reliability.py --repeat 3 --kills 10 --out benchmarks/reliability.json

--repeat: `hf-moe-offload train --steps 300 --batch-size 1 --block-size 32 --max-eval-blocks 4 --logging-steps 25
--max-train-blocks 400` (disk tier, default pinning), which died 3 times out of 3 with "expert file ... is truncated"
before the disk tier's ownership rework; each run must exit 0.

--kills: a run with --save-steps 2 is killed (SIGKILL) a random 0-400 ms after a new checkpoint folder appears, i.e.
while that checkpoint is being written. Then, as a resumed run does, the interrupted saves are cleaned and
transformers' own `get_last_checkpoint` is asked which checkpoint it would resume from: it must be complete. Then
`--resume` runs to the end and must exit 0. Also counted: how often the folder the Trainer would have picked
*before* cleaning was incomplete (what users hit before).

Prints a table and writes JSON (--out).
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import random
import shutil
import signal
import subprocess
import sys
import tempfile
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
DEFAULT_RUN = ["--steps", "300", "--batch-size", "1", "--block-size", "32", "--max-eval-blocks", "4",
               "--logging-steps", "25", "--max-train-blocks", "400"]
KILL_RUN = ["--steps", "24", "--batch-size", "2", "--block-size", "32", "--max-eval-blocks", "2", "--logging-steps",
            "4", "--eval-steps", "1000", "--max-train-blocks", "200", "--save-steps", "2", "--save-total-limit", "2"]


def cli(*args: str) -> list[str]:
    return [sys.executable, "-m", "hf_moe_offload.cli.main", "--log-level", "WARNING", "train", *args]


def repeat_default(n: int, work: str) -> list[dict]:
    rows = []
    for i in range(n):
        out = os.path.join(work, f"repeat{i}")
        t0 = time.perf_counter()
        res = subprocess.run(cli(*DEFAULT_RUN, "--output-dir", out), capture_output=True, text=True, cwd=ROOT)
        seconds = time.perf_counter() - t0
        tail = (res.stdout + res.stderr)[-4000:]
        rows.append({"run": i, "exit_code": res.returncode, "seconds": round(seconds, 1),
                     "corrupt_expert_file_error": "CorruptExpertFileError" in tail or "is truncated" in tail,
                     "train_loss_line": next((ln.strip() for ln in res.stdout.splitlines() if "train loss" in ln), None)})
        print(f"repeat {i}: exit {res.returncode} in {seconds:.0f} s; {rows[-1]['train_loss_line']}", flush=True)
        shutil.rmtree(out, ignore_errors=True)
    return rows


def _checkpoints(out: str) -> set[str]:
    return {n for n in os.listdir(out) if n.startswith("checkpoint-")} if os.path.isdir(out) else set()


def kill_during_saves(n: int, work: str, seed: int) -> list[dict]:
    from transformers.trainer_utils import get_last_checkpoint

    from hf_moe_offload.optim.checkpoints import checkpoint_problems, clean_interrupted_saves

    rng = random.Random(seed)
    rows = []
    for i in range(n):
        out = os.path.join(work, f"kill{i}")
        proc = subprocess.Popen(cli(*KILL_RUN, "--output-dir", out), stdout=subprocess.DEVNULL,
                                stderr=subprocess.DEVNULL, cwd=ROOT)
        # Aim at a save: wait for the k-th new checkpoint folder, then kill a random moment later.
        target = rng.randint(2, 6)
        seen: set[str] = set()
        while proc.poll() is None and len(seen) < target:
            seen |= _checkpoints(out)
            time.sleep(0.005)
        delay = rng.random() * 0.4
        time.sleep(delay)
        if proc.poll() is None:
            os.kill(proc.pid, signal.SIGKILL)
        proc.wait()
        stock_pick = get_last_checkpoint(out)  # what the Trainer alone would resume from
        stock_incomplete = bool(stock_pick and checkpoint_problems(stock_pick))
        removed = clean_interrupted_saves(out)
        pick = get_last_checkpoint(out)
        problems = checkpoint_problems(pick) if pick else ["no checkpoint"]
        res = subprocess.run(cli(*KILL_RUN, "--output-dir", out, "--resume"), capture_output=True, text=True,
                             cwd=ROOT)
        rows.append({"run": i, "killed": proc.returncode == -signal.SIGKILL, "kill_delay_s": round(delay, 3),
                     "stock_pick": os.path.basename(stock_pick) if stock_pick else None,
                     "stock_pick_incomplete": stock_incomplete, "removed_leftovers": len(removed),
                     "pick_after_cleaning": os.path.basename(pick) if pick else None, "pick_problems": problems,
                     "resume_exit_code": res.returncode})
        print(f"kill {i}: killed={rows[-1]['killed']} +{delay:.3f}s; Trainer alone would pick {rows[-1]['stock_pick']}"
              f" ({'INCOMPLETE' if stock_incomplete else 'complete'}); after cleaning: {rows[-1]['pick_after_cleaning']}"
              f" {'complete' if not problems else problems}; resume exit {res.returncode}", flush=True)
        if res.returncode != 0:
            print(res.stderr[-3000:], flush=True)
        shutil.rmtree(out, ignore_errors=True)
    return rows


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--repeat", type=int, default=0)
    p.add_argument("--kills", type=int, default=0)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--out", default=os.path.join(ROOT, "benchmarks", "reliability.json"))
    args = p.parse_args()
    work = tempfile.mkdtemp(prefix="hf_moe_reliability-")
    result = {"machine": f"{platform.machine()}, {os.cpu_count()} cores", "python": platform.python_version()}
    try:
        if args.repeat:
            result["repeat_default"] = repeat_default(args.repeat, work)
        if args.kills:
            result["kills"] = kill_during_saves(args.kills, work, args.seed)
    finally:
        shutil.rmtree(work, ignore_errors=True)
    print("\n| measurement | result |\n|---|---|")
    if "repeat_default" in result:
        rows = result["repeat_default"]
        ok = sum(r["exit_code"] == 0 for r in rows)
        print(f"| 300-step default-path command, runs that finished | {ok} of {len(rows)} "
              f"({', '.join(str(r['seconds']) + ' s' for r in rows)}) |")
    if "kills" in result:
        rows = [r for r in result["kills"] if r["killed"]]
        print(f"| SIGKILLs during a checkpoint save | {len(rows)} |")
        print(f"| ... where the Trainer alone would resume from an incomplete checkpoint | "
              f"{sum(r['stock_pick_incomplete'] for r in rows)} |")
        print(f"| ... where it does after our cleaning | {sum(bool(r['pick_problems']) for r in rows)} |")
        print(f"| ... `--resume` runs that finished | {sum(r['resume_exit_code'] == 0 for r in rows)} |")
    with open(args.out, "w") as f:
        json.dump(result, f, indent=2)
    print(f"\nwrote {args.out}")


if __name__ == "__main__":
    main()
