"""``bench e2e --trace``: the per-gather account (account.py) on disk: one JSON and one
timeline figure per model and world size, rank 0's traced iterations.

The figure has one panel per (variant, iteration), each with a compute lane (kernels; in
red the stretches a gather held the compute idle) and a lane per kind of copy (peer reads,
own rows, NCCL), each gather labelled by its weights above the copies: which weight
arrives late is visible at a glance.
"""
from __future__ import annotations

import os

from . import common as C
from .account import account, timeline_rows

LABEL_MIN_FRACTION = 0.015  # label a gather only if its copies span this much of the panel


def short_label(params: list[str]) -> str:
    """``layers.3.feed_forward.w1.weight`` -> ``L3 w1``; several weights joined by ``+``."""
    out = []
    for p in params:
        parts = [x for x in p.split(".") if x not in ("weight", "original", "parametrizations", "_orig_mod")]
        if len(parts) >= 2 and parts[0] == "layers":
            out.append(f"L{parts[1]} {parts[-1]}")
        else:
            out.append(".".join(parts) or p)
    return "+".join(out)


def build(traced: dict, W: int, model: str) -> dict:
    """The account of every traced variant with gathers, per token count: ``traced`` maps
    T -> variant -> dict(events=compact trace, labels=[...]); ``bound`` is the reference."""
    out: dict = dict(model=model, world_size=W, rank=0, tokens={})
    for T, per in traced.items():
        bound = (per.get("bound") or {}).get("events")
        out["tokens"][str(T)] = {v: account(d["events"], d.get("labels"), bound)
                                 for v, d in per.items() if v != "bound" and d.get("events")}
    return out


def write(out_dir: str, traced: dict, W: int, model: str) -> tuple[str, str | None]:
    """``account_<model>_<W>.json`` and ``timeline_<model>_<W>.png`` in ``out_dir``."""
    acct = build(traced, W, model)
    base = os.path.join(out_dir, f"{{}}_{model}_{W}")
    path = C.write_json(base.format("account") + ".json", acct)
    png = C.save_png(base.format("timeline") + ".png", lambda plt: draw(plt, traced, acct))
    return path, png


def draw(plt, traced: dict, acct: dict):
    panels = [(T, v, i) for T, per in acct["tokens"].items() for v, a in per.items()
              for i in range(len(a["iterations"]))]
    fig, axes = plt.subplots(max(len(panels), 1), 1, figsize=(16, 1.9 * max(len(panels), 1)), squeeze=False)
    for ax, (T, v, i) in zip(axes[:, 0], panels):
        a = acct["tokens"][T][v]
        rows = timeline_rows(traced[int(T)][v]["events"], a, i)
        lanes = ["compute", *rows["lanes"]]
        y = {name: len(lanes) - 1 - j for j, name in enumerate(lanes)}
        ax.broken_barh(rows["compute"], (y["compute"] - 0.4, 0.8), color="tab:blue")
        ax.broken_barh(rows["exposed"], (y["compute"] - 0.4, 0.8), color="tab:red")
        for name, bars in rows["lanes"].items():
            ax.broken_barh(bars, (y[name] - 0.4, 0.8), color={"own rows": "tab:gray"}.get(name, "tab:orange"))
        span = max(a["iterations"][i]["span_us"], 1.0)
        top = max(y.values()) + 0.45
        for j, (label, s, e, exp) in enumerate(rows["gathers"]):
            if (e - s) / span >= LABEL_MIN_FRACTION or exp > 0:
                ax.text(s, top + 0.35 * (j % 2), label + (f" ({exp:.0f})" if exp > 0 else ""), fontsize=6,
                        color="tab:red" if exp > 0 else "black", clip_on=True)
        it = a["iterations"][i]
        slow = f"{it['slowdown_under_copy']:.3f}x" if it["slowdown_under_copy"] else "n/a"
        ax.set_yticks([y[n] for n in lanes])
        ax.set_yticklabels(lanes, fontsize=7)
        ax.set_ylim(-0.6, top + 1.0)
        ax.set_xlim(0, span * 1.01)
        ax.set_title(f"{acct['model']}, world {acct['world_size']}, rank 0: {T} tokens, {v}, iteration {i}: "
                     f"span {it['span_us'] / 1e3:.2f} ms, exposed (red, us in brackets) {it['exposed_us']:.0f} us, "
                     f"idle beside own rows {it.get('idle_beside_own_rows_us', 0):.0f} us, "
                     f"compute under copy {slow} bound", fontsize=8)
        ax.grid(True, axis="x", alpha=0.3)
    axes[-1, 0].set_xlabel("us from the iteration's start")
    fig.tight_layout()
    return fig
