"""``torch_ce.explain()``: callable any number of times, one row per weight per graph,
named by parameter, with the window and offset the weight really sits at.

The multi-process test compiles three SimpleFSDP-style models (torch's parametrize, so
Dynamo's sources read ``..._modules['parametrizations']._modules['weight']._parameters
['original']``) on 2 gloo ranks with the host transport and calls ``explain()`` after each,
with imports of torch_ce's submodules in between (``import torch_ce.explain`` used to turn
the function into a module after the first call). One model reads its embedding weight
twice per forward, as torchtitan's ``Embedding.forward`` does: two gathers, one row.
"""
from __future__ import annotations

import importlib
import importlib.machinery
import json
import pkgutil
import random
import subprocess
import sys

import pytest
import torch

import torch_ce
from mp_harness import TitanEmbedding, fsdp_every_param, run_ranks, setup_compile
from torch_ce.explanation import Coverage
from torch_ce.passes.param_names import fqn_from_source, roots_of
from torch_ce.runtime import native

TIMEOUT = 150
PACKAGES = ["torch_ce", "torch_ce.runtime", "torch_ce.passes"]


# ---------------------------------------------------------------------------------------
# Names: package attributes never collide with submodules
# ---------------------------------------------------------------------------------------


def _submodules(pkg: str) -> list[str]:
    """``pkg``'s Python submodules. The built C++ kernels (``runtime/_ce_torch*.so``) are a
    torch op library, not a Python extension module: ``runtime.native.load()`` loads them
    (``torch.ops.load_library``); importing them as a module fails (no ``PyInit``)."""
    out = []
    for m in pkgutil.iter_modules(importlib.import_module(pkg).__path__):
        spec = m.module_finder.find_spec(f"{pkg}.{m.name}")
        if not isinstance(spec.loader, importlib.machinery.ExtensionFileLoader):
            out.append(m.name)
    return out


def test_public_names_are_not_submodule_names():
    """``import pkg.x`` sets ``pkg.x`` to the module on first import: a public function or
    object named like a submodule would be replaced by it."""
    for pkg in PACKAGES:
        mod = importlib.import_module(pkg)
        public = set(getattr(mod, "__all__", [])) | {
            k for k, v in vars(mod).items()
            if not k.startswith("_") and not isinstance(v, type(torch)) and callable(v)}
        clash = public & set(_submodules(pkg))
        if pkg == "torch_ce":
            # torch_ce.config (the Config object) shadows torch_ce/config.py on purpose: the
            # package imports the module first, so no later import rebinds it (checked below).
            clash -= {"config"}
        assert not clash, f"{pkg}: public names that are also submodules: {sorted(clash)}"


def test_importing_every_submodule_keeps_the_public_api():
    before = {k: getattr(torch_ce, k) for k in torch_ce.__all__}
    for pkg in PACKAGES:
        for name in _submodules(pkg):
            try:
                importlib.import_module(f"{pkg}.{name}")
            except ImportError as e:  # an optional third-party dependency is absent
                if (e.name or "").startswith("torch_ce"):
                    raise
    # What the statements ``import torch_ce.config`` / ``import torch_ce.explanation`` run.
    __import__("torch_ce.config")
    __import__("torch_ce.explanation")
    native.load()  # the C++ kernels, by the product's loader (a no-op where none is built)

    changed = [k for k, v in before.items() if getattr(torch_ce, k) is not v]
    assert not changed, f"importing submodules rebound torch_ce attributes: {changed}"
    assert isinstance(torch_ce.config, torch_ce.config.__class__) and hasattr(torch_ce.config, "transport")
    for _ in range(3):
        assert isinstance(torch_ce.explain(), torch_ce.explanation.Explanation)


def test_header_names_the_transport_and_the_torch():
    """The table's first line says which transport and which torch (a report pasted into an
    issue says what it ran on); ``as_dict()`` carries the torch too."""
    e = torch_ce.explain()
    assert e.table().splitlines()[0] == (
        f"torch_ce explain (transport={torch_ce.config.transport}, torch {torch.__version__})")
    assert e.as_dict()["torch"] == torch.__version__


@pytest.mark.parametrize("source,fqn", [
    ("L['self']._modules['layers']._modules['0']._modules['attention']._modules['wqkv']._parameters['weight']",
     "layers.0.attention.wqkv.weight"),
    ("L['self']._modules['ok']._modules['parametrizations']._modules['weight']._parameters['original']",
     "ok.weight"),
    ("L['self']._modules['m']._modules['parametrizations']._modules['w']._parameters['original1']", "m.w"),
    ("L['model']._modules['head']._parameters['bias']", "model.head.bias"),
    ("L['self'].layers[0].weight", "layers.0.weight"),
    ("G['net']._modules['fc']._buffers['scale']", "net.fc.scale"),
    ("L['fn']._modules['0']._parameters['weight']", "0.weight"),  # torch.compile(nn.Sequential)
    ("L['x']", "x"),
    ("L['self']._modules['a'].foo()", None),
])
def test_fqn_from_source(source, fqn):
    assert fqn_from_source(source) == fqn


def test_fqn_from_a_decorated_forward():
    """Hugging Face transformers 5 wraps its forwards (``def wrapper(*args, **kwargs)``): the
    compiled frame holds the module in ``args[0]``, and names drop that root as they drop
    ``self`` (issue 47). A root is a module variable, or a module in a tuple, list or dict
    variable; other elements keep their path."""
    lin = torch.nn.Linear(2, 2)
    roots = roots_of({"args": (lin, torch.ones(1)), "kwargs": {"head": lin, "n": 3}, "self": lin,
                      "xs": [1, lin], "x": torch.ones(1)})
    assert roots == {("args", "0"), ("kwargs", "head"), ("self",), ("xs", "1")}, roots
    src = "L['args'][0]._modules['model']._modules['layers']._modules['0']._modules['q_proj']._parameters['weight']"
    assert fqn_from_source(src, roots) == "model.layers.0.q_proj.weight"
    assert fqn_from_source(src) == "args.0.model.layers.0.q_proj.weight"  # without the frame's values
    assert fqn_from_source("L['args'][1]", roots) == "args.1"
    assert fqn_from_source("L['kwargs']['head']._parameters['bias']", roots) == "bias"
    # The longest root wins; a plain string is a variable (the older form).
    assert fqn_from_source("L['self']._modules['a']._parameters['w']", {"self"}) == "a.w"
    assert fqn_from_source("G['args'][0]._parameters['w']", roots) == "args.0.w"  # globals keep their root


# ---------------------------------------------------------------------------------------
# Rank side
# ---------------------------------------------------------------------------------------


class _LM(torch.nn.Module):
    def __init__(self, vocab, dim, layers):
        super().__init__()
        self.tok_embeddings = TitanEmbedding(vocab, dim)
        self.layers = torch.nn.ModuleList(torch.nn.Linear(dim, dim) for _ in range(layers))

    def forward(self, t):
        h = self.tok_embeddings(t)
        for lin in self.layers:
            h = h + lin(h)
        return h


def _param_names(model) -> list[str]:
    """The user's names: parametrize's ``parametrizations.weight.original`` -> ``weight``."""
    return [n.replace("parametrizations.", "").replace(".original", "") for n, _ in model.named_parameters()]


def _rank(rank, ws, seed, cache_root):
    setup_compile(cache_root, rank)
    import torch_ce
    import torch_ce.explanation  # noqa: F401  (before the first call: must not matter)
    from torch.distributed.device_mesh import init_device_mesh
    from torch_ce.runtime import windows as W

    mesh = init_device_mesh("cpu", (ws,))
    torch.manual_seed(seed)  # the same weights on every rank
    models = [fsdp_every_param(_LM(64, 16, 2).eval(), mesh), fsdp_every_param(_LM(32, 8, 1).eval(), mesh),
              fsdp_every_param(torch.nn.Sequential(torch.nn.Linear(8, 8), torch.nn.Linear(8, 4)).eval(), mesh)]
    gen = torch.Generator().manual_seed(seed + 1 + rank)
    inputs = [torch.randint(0, 64, (2, 5), generator=gen), torch.randint(0, 32, (2, 5), generator=gen),
              torch.randn(3, 8, generator=gen)]
    out = []
    torch_ce.enable(transport="copy_engine")
    try:
        for i, (model, x) in enumerate(zip(models, inputs, strict=True)):
            with torch.no_grad():
                eager = model(x)
                got = torch.compile(model, fullgraph=True)(x)
            if i == 1:
                import torch_ce.config  # noqa: F401
                import torch_ce.passes.manager  # noqa: F401
            e = torch_ce.explain()  # the call that raised "'module' object is not callable"
            # Reference per weight: where the registry says its local shard lives.
            where = {}
            for name, (pn, p) in zip(_param_names(model), model.named_parameters(), strict=True):
                slot = W.lookup(p._local_tensor)
                where[name] = (type(slot).__name__, getattr(slot, "window", None) and slot.window.index,
                               getattr(slot, "offset", None), p._local_tensor.nbytes)
            out.append(dict(
                exact=torch.equal(got, eager),
                names=_param_names(model),
                where=where,
                graph_ids=[g.graph_id for g in e.graphs],
                rows=[(w.graph_id, w.param, w.status, w.window, w.offset, w.bytes, w.gathers)
                      for w in e.weights],
                table=e.table(),
            ))
        return out
    finally:
        torch_ce.disable()


def test_explain_three_times_with_param_names(tmp_path):
    seed = random.randrange(1 << 20)
    res = run_ranks(_rank, 2, seed, str(tmp_path.resolve()), timeout=TIMEOUT)
    for rank, steps in enumerate(res):
        for i, s in enumerate(steps):
            ctx = f"rank {rank}, model {i} (seed {seed})"
            assert s["exact"], f"{ctx}: compiled != eager"
            assert len(s["graph_ids"]) == i + 1, f"{ctx}: graphs {s['graph_ids']}"
            gid = s["graph_ids"][-1]
            rows = [r for r in s["rows"] if r[0] == gid]
            # Every weight once, by its parameter name, where the registry has it.
            assert sorted(r[1] for r in rows) == sorted(s["names"]), (ctx, rows, s["names"])
            for _, param, status, window, offset, nbytes, gathers in rows:
                kind, ref_window, ref_offset, ref_bytes = s["where"][param]
                assert kind == "Slot" and status == "bound", (ctx, param, status, kind)
                assert (window, offset, nbytes) == (ref_window, ref_offset, ref_bytes), (ctx, param)
                want_gathers = 2 if param == "tok_embeddings.weight" else 1
                assert gathers == want_gathers, (ctx, param, gathers)
                assert param in s["table"], (ctx, param, s["table"])
            assert "arg0_1" not in s["table"], (ctx, s["table"])
            head = f"torch_ce explain (transport=copy_engine, torch {torch.__version__})"
            assert s["table"].splitlines()[0] == head, (ctx, s["table"])


# ---------------------------------------------------------------------------------------
# Nothing seen is not 100%
# ---------------------------------------------------------------------------------------


def test_fresh_process_explain_says_no_gather_seen():
    """A fresh process (no graph compiled, no weight gather counted): explain() says so in
    words and prints no percentage; coverage() reports "nothing seen" (``seen`` False,
    ``share`` None), which a caller can tell from a measured 100%."""
    code = ("import json, torch_ce; e = torch_ce.explain(); c = e.coverage();"
            "print(json.dumps(dict(table=e.table(), seen=c.seen, total=c.total.as_dict())))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                         timeout=120, check=True).stdout
    r = json.loads(out.strip().splitlines()[-1])
    assert "coverage total: no weight gather seen yet (no graph compiled in this process)" \
        in r["table"], r["table"]
    assert "%" not in r["table"], r["table"]
    assert r["seen"] is False and r["total"]["seen"] is False, r
    assert r["total"]["share"] is None and r["total"]["weights"] == 0, r


def test_coverage_tells_nothing_seen_from_zero_bytes_and_from_a_share():
    """The three states of a Coverage: nothing seen, gathers of 0 B (said as such, with
    the reason), and a measured share."""
    c = Coverage()
    assert not c.seen and c.share is None and "no weight gather seen yet" in c.line()
    ce, coll = random.randint(1, 1000), random.randint(1, 1000)
    c.add(0, {})
    assert c.seen and c.share is None
    assert c.line().startswith("coverage total: 0 gathered B in 1 weight gather(s)"), c.line()
    c.add(ce, {"not a weight": coll})
    assert c.share == pytest.approx(ce / (ce + coll))
    assert f"{100 * ce / (ce + coll):.1f}% of {ce + coll:,d} gathered B" in c.line(), c.line()
    assert f"{coll:,d} B not a weight" in c.line(), c.line()
