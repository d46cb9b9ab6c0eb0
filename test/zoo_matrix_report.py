"""Run the zoo matrix (test/zoo_matrix.py) case by case and print a table: case, status,
copy-engine share (lowest over the ranks), wall time, what the case still needs on
today's main, and the first failure line.

    cd <repo> && PYTHONPATH=$PWD python test/zoo_matrix_report.py            # every case
    PYTHONPATH=$PWD python test/zoo_matrix_report.py -k moe -k w4            # ids with all of these
    PYTHONPATH=$PWD python test/zoo_matrix_report.py --default --out DIR     # the CI subset

Each case runs in a subprocess of its own (this script with ``--case ID``), under the
case's own timeout (the harness dumps every rank's stacks at it and kills the ranks), plus
a margin for this script. Status:

- pass: outputs / losses bit-identical to the plain compiled run on every rank and a
  copy-engine share >= 0.99;
- fail: a rank raised, or a check failed (the reason is printed);
- hang: the harness timed out and the ranks' stacks show them in a collective or in a
  bind exchange;
- timeout: it timed out elsewhere (slowness, not a wait on a peer).

``--out DIR`` keeps each case's log (``<id>.log``: stdout and stderr, stacks included) and
its result (``<id>.json``), and ``report.json`` with every row.
"""
from __future__ import annotations

import argparse
import json
import os
import re
import signal
import subprocess
import sys
import tempfile
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import zoo_matrix as M  # noqa: E402

MARGIN_S = 90  # process start, imports, the harness's kill and stack dumps
# The innermost frames of a rank waiting on its peers (a hang, not slowness): a collective,
# a wait on one, the store (bind exchanges), a barrier.
WAITING = re.compile(r"distributed_c10d|_functional_collectives|_c10d_functional|wait_tensor|"
                     r"torch_ce/runtime/agreement|torch_ce/_net|store|barrier|gloo")
INNERMOST = 4  # frames per rank that decide


def run_one(case_id: str, json_path: str, cache: str) -> int:
    """Child mode: run one case on its ranks, write its result, exit 0 if it passes."""
    import pytest

    from mp_harness import run_ranks, seed_base

    c = M.CASES[case_id]
    seed = seed_base()
    out = dict(case=case_id, seed=seed)
    t0 = time.monotonic()
    try:
        res = run_ranks(M.run_case, c.world, vars(c), seed, cache, timeout=c.timeout,
                        env={"TORCH_CE_BIND_ARRIVAL_TIMEOUT_S": str(c.timeout // 2)})
        bad = M.failures(c, res) + M.shape_checks(c, res[0]["placements"])
        shares = [r["coverage"]["total"]["share"] for r in res]
        out.update(status="pass" if not bad else "fail", problems=bad,
                   share=min((s for s in shares if s is not None), default=None),
                   coverage=[r["coverage"] for r in res], table_rank0=res[0]["table"])
    except pytest.fail.Exception as e:  # a rank raised, or the harness timed out
        msg = str(e)
        out.update(status="timed_out" if "timed out (hang?)" in msg else "fail", problems=[msg[-4000:]])
    out["wall_s"] = round(time.monotonic() - t0, 1)
    with open(json_path, "w") as f:
        json.dump(out, f, indent=1, default=str)
    return 0 if out["status"] == "pass" else 1


def _classify(result: dict | None, log: str, rc: int | None) -> str:
    """pass / fail from the child's result; a harness timeout is a hang when every rank
    still running sits in a wait on its peers (its innermost frames), else a timeout."""
    if result is None:
        return "timeout" if rc is None else "fail"
    if result["status"] != "timed_out":
        return result["status"]
    blocks = log.split("still running: its stacks ----")[1:]
    if not blocks:
        return "timeout"
    for b in blocks:
        frames = [ln for ln in b.splitlines() if ln.strip().startswith("File ")][:INNERMOST]
        if not any(WAITING.search(f) for f in frames):
            return "timeout"
    return "hang"


def _first_problem(result: dict | None, log: str) -> str:
    if result and result.get("problems"):
        text = result["problems"][0]
        lines = [ln.strip() for ln in text.splitlines() if ln.strip()]
        # A rank's traceback: its last line is the error.
        errs = [ln for ln in lines if re.match(r"^[\w.]+(Error|Exception|Failed)\b", ln)]
        return (errs[-1] if errs else lines[0])[:160]
    tail = [ln for ln in log.splitlines() if ln.strip()][-1:] or [""]
    return tail[0][:160]


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--case", help=argparse.SUPPRESS)
    ap.add_argument("--json", help=argparse.SUPPRESS)
    ap.add_argument("--cache", help=argparse.SUPPRESS)
    ap.add_argument("-k", action="append", default=[], help="run only ids containing this (repeatable: all)")
    ap.add_argument("--default", action="store_true", help="only the default CI subset")
    ap.add_argument("--list", action="store_true", help="list the case ids and exit")
    ap.add_argument("--out", help="keep logs and results here")
    a = ap.parse_args(argv)
    if a.case:
        return run_one(a.case, a.json, a.cache)
    ids = list(M.DEFAULT) if a.default else list(M.CASES)
    ids = [i for i in ids if all(k in i for k in a.k)]
    if a.list:
        for i in ids:
            print(i, " ".join(sorted(M.CASES[i].needs)))
        return 0
    out = a.out or tempfile.mkdtemp(prefix="zoo_matrix_report_")
    os.makedirs(out, exist_ok=True)
    cache = os.path.join(out, "inductor")  # per rank, shared by the cases (M.run_case)
    rows = []
    head = f"{'case':<44} {'status':<8} {'CE share':>9} {'wall s':>7}  {'needs (today)':<20} first problem"
    print(head, flush=True)
    for cid in ids:
        c = M.CASES[cid]
        jpath, lpath = os.path.join(out, f"{cid}.json"), os.path.join(out, f"{cid}.log")
        if os.path.exists(jpath):
            os.remove(jpath)
        t0 = time.monotonic()
        rc = None
        with open(lpath, "w") as log:
            # A session of its own: on our timeout the child and its ranks go together.
            p = subprocess.Popen([sys.executable, os.path.abspath(__file__), "--case", cid, "--json", jpath,
                                  "--cache", cache],
                                 stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
            try:
                rc = p.wait(timeout=c.timeout + MARGIN_S)
            except subprocess.TimeoutExpired:
                os.killpg(p.pid, signal.SIGKILL)
                p.wait()
        wall = time.monotonic() - t0
        result = json.load(open(jpath)) if os.path.exists(jpath) else None
        text = open(lpath, errors="replace").read()
        status = _classify(result, text, rc)
        share = result.get("share") if result else None
        row = dict(case=cid, status=status, share=share, wall_s=round(wall, 1), needs=sorted(c.needs),
                   problem="" if status == "pass" else _first_problem(result, text))
        rows.append(row)
        sh = "-" if share is None else f"{100 * share:.1f}%"
        print(f"{cid:<44} {status:<8} {sh:>9} {wall:>7.0f}  {','.join(row['needs']) or '-':<20} {row['problem']}",
              flush=True)
    with open(os.path.join(out, "report.json"), "w") as f:
        json.dump(rows, f, indent=1)
    n = {s: sum(r["status"] == s for r in rows) for s in ("pass", "fail", "hang", "timeout")}
    print(f"\n{len(rows)} case(s): " + ", ".join(f"{v} {k}" for k, v in n.items()) + f"; logs in {out}")
    return 0 if n["pass"] == len(rows) else 1


if __name__ == "__main__":
    sys.exit(main())
