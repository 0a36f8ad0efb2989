"""numbanorm.torch.replace_norms on Hugging Face transformers models (tiny random configs, no downloads)."""

import copy
import pickle
import sys
from pathlib import Path

import numpy as np
import pytest

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")

import numbanorm.torch as nt  # noqa: E402
from conftest import TOL  # noqa: E402

T = transformers
ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))  # the repository's benchmarks/ package (not installed)
F32 = TOL[np.float32]
DECODER = dict(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
               num_key_value_heads=2, head_dim=8, max_position_embeddings=32)
VOCAB = 64

# name -> a tiny model with random weights; every one is built from its config alone
MODELS = {
    "gpt2": lambda: T.GPT2Model(T.GPT2Config(vocab_size=VOCAB, n_embd=32, n_layer=2, n_head=4, n_positions=32)),
    "bert": lambda: T.BertModel(T.BertConfig(vocab_size=VOCAB, hidden_size=32, num_hidden_layers=2,
                                             num_attention_heads=4, intermediate_size=64,
                                             max_position_embeddings=32)),
    "llama": lambda: T.LlamaForCausalLM(T.LlamaConfig(**DECODER)),
    "qwen2": lambda: T.Qwen2ForCausalLM(T.Qwen2Config(**DECODER)),
    "qwen3": lambda: T.Qwen3ForCausalLM(T.Qwen3Config(**DECODER)),  # q_norm/k_norm over head_dim too
    "mistral": lambda: T.MistralForCausalLM(T.MistralConfig(**DECODER)),
    "phi3": lambda: T.Phi3ForCausalLM(T.Phi3Config(**DECODER, pad_token_id=0)),
    "gemma": lambda: T.GemmaForCausalLM(T.GemmaConfig(**DECODER)),
    "olmo2": lambda: T.Olmo2ForCausalLM(T.Olmo2Config(**DECODER, pad_token_id=0)),
    "t5": lambda: T.T5EncoderModel(T.T5Config(vocab_size=VOCAB, d_model=32, d_kv=8, d_ff=64, num_layers=2,
                                              num_heads=4)),
}


def tiny(name, dtype=torch.float32):
    """The model in eval mode (no dropout), norm parameters moved off their ones/zeros init."""
    torch.manual_seed(0)
    model = MODELS[name]().to(dtype).eval()
    g = torch.Generator().manual_seed(1)
    with torch.no_grad():
        for m in model.modules():
            if is_norm(m):
                for p in m.parameters(recurse=False):
                    p.add_((0.3 * torch.randn(p.shape, generator=g)).to(p.dtype))
    return model


def is_norm(m):
    return (isinstance(m, (torch.nn.LayerNorm, torch.nn.RMSNorm, torch.nn.GroupNorm))
            or ("Norm" in type(m).__name__ and not any(True for _ in m.children())))


def ids(seed=0, shape=(2, 7)):
    return torch.randint(0, VOCAB, shape, generator=torch.Generator().manual_seed(seed))


def output(model, x):
    out = model(input_ids=x)
    return out.logits if hasattr(out, "logits") else out.last_hidden_state


def assert_close(a, b, tol, what=""):
    scale = max(1.0, b.abs().max().item())
    torch.testing.assert_close(a, b, rtol=tol, atol=tol * scale, msg=lambda m: f"{what}: {m}")


# ------------------------------------------------------------ whole models

@pytest.mark.parametrize("name", list(MODELS))
def test_every_norm_replaced_same_outputs_and_gradients(name):
    ref = tiny(name)
    ours, report = nt.replace_norms(copy.deepcopy(ref), report=True)
    n_norms = sum(is_norm(m) for m in ref.modules())
    assert n_norms > 0 and len(report.replaced) == n_norms, str(report)
    assert report.left_alone == []
    # every norm runs numbanorm: torch's own classes swapped for nt's, the others for generated subclasses
    for (path, m), (_, r) in zip(ours.named_modules(), ref.named_modules()):
        if is_norm(r):
            assert isinstance(m, type(r)) and type(m) is not type(r), path
            assert type(m).forward is not type(r).forward
    same_outputs_and_gradients(ours, ours, ref)


@pytest.mark.parametrize("reentrant", [False, True])
@pytest.mark.parametrize("name", ["gpt2", "llama"])
def test_gradient_checkpointing(name, reentrant):
    """transformers' gradient checkpointing (``gradient_checkpointing_enable``, in train mode)
    over swapped norms, two steps: the same gradients as the model's own norms.  Without
    reentrance the first step raised (see test_torch's test_activation_checkpointing)."""
    ref = tiny(name)
    ours = nt.replace_norms(copy.deepcopy(ref))
    for m in (ours, ref):
        m.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": reentrant})
        m.train()  # (checkpointing is for training), without dropout: the same arithmetic in both
        m.config.use_cache = False
        for d in m.modules():
            if isinstance(d, torch.nn.Dropout):
                d.p = 0.0
    for step in range(2):
        for m in (ours, ref):
            m.zero_grad()
            output(m, ids(seed=step)).square().mean().backward()
        for (n, p), (_, q) in zip(ours.named_parameters(), ref.named_parameters()):
            if q.grad is not None or p.grad is not None:
                assert_close(p.grad, q.grad, 10 * F32, n)


def same_outputs_and_gradients(run, ours, ref):
    """``run`` (``ours`` or a compiled ``ours``) against ``ref``: logits and every parameter's gradient."""
    x = ids()
    ya, yr = output(run, x), output(ref, x)
    # float32: ulp-level differences in the norms pass through a few layers
    assert_close(ya, yr, 10 * F32, "output")
    g = torch.randn(ya.shape, generator=torch.Generator().manual_seed(3))
    (ya * g).sum().backward()
    (yr * g).sum().backward()
    for (n, p), (_, q) in zip(ours.named_parameters(), ref.named_parameters()):
        if q.grad is not None or p.grad is not None:
            assert_close(p.grad, q.grad, 10 * F32, n)


@pytest.mark.parametrize("name", ["llama", "gemma", "t5"])
def test_float16_inference(name):
    """16 bits: each form's casts in the original's places, so outputs agree to float16 rounding."""
    ref = tiny(name, torch.float16)
    ours = nt.replace_norms(copy.deepcopy(ref))
    with torch.no_grad():
        ya, yr = output(ours, ids()), output(ref, ids())
    assert ya.dtype == torch.float16
    assert_close(ya.float(), yr.float(), 5 * TOL[np.float16], name)


@pytest.mark.parametrize("name", ["gpt2", "llama", "gemma", "t5"])
def test_bfloat16_inference(name):
    """bfloat16 models on the CPU: tensors cross as ml_dtypes views, each form rounds where the original does."""
    ref = tiny(name, torch.bfloat16)
    ours = nt.replace_norms(copy.deepcopy(ref))
    with torch.no_grad():
        ya, yr = output(ours, ids()), output(ref, ids())
    assert ya.dtype == torch.bfloat16
    assert_close(ya.float(), yr.float(), 4 * torch.finfo(torch.bfloat16).eps, name)


def test_parameters_state_dict_and_from_pretrained(tmp_path):
    ref = tiny("llama")
    params = dict(ref.named_parameters())
    keys = list(ref.state_dict())
    ours = nt.replace_norms(ref)
    assert ours is ref and all(p is params[n] for n, p in ours.named_parameters())
    assert list(ours.state_dict()) == keys
    x = ids()
    with torch.no_grad():
        y = output(ours, x)
    ours.save_pretrained(tmp_path / "ours")  # what a replaced model saves, the original class loads
    loaded = T.LlamaForCausalLM.from_pretrained(tmp_path / "ours").eval()
    assert type(loaded.model.norm) is T.models.llama.modeling_llama.LlamaRMSNorm
    assert list(loaded.state_dict()) == keys
    with torch.no_grad():
        assert_close(output(loaded, x), y, 10 * F32, "loaded original")
        replaced = nt.replace_norms(T.LlamaForCausalLM.from_pretrained(tmp_path / "ours").eval())
        torch.testing.assert_close(output(replaced, x), y, rtol=0, atol=0)
    ours.load_state_dict(loaded.state_dict())


def test_pickle_and_deepcopy_keep_the_replacement():
    model = nt.replace_norms(tiny("gemma"))
    norm = model.model.norm
    for twin in (pickle.loads(pickle.dumps(norm)), copy.deepcopy(norm)):
        assert type(twin) is type(norm) and twin.weight is not norm.weight
        x = torch.randn(3, 32)
        torch.testing.assert_close(twin(x), norm(x), rtol=0, atol=0)


# ------------------------------------------------------------ single modules: each form's arithmetic

def _module(cls_path, n=48):
    mod, cls = cls_path.rsplit(".", 1)
    m = getattr(__import__(f"transformers.models.{mod}", fromlist=[cls]), cls)(n)
    with torch.no_grad():
        m.weight.copy_(torch.rand(n, generator=torch.Generator().manual_seed(4)) + 0.25)
    return m


RMS_CLASSES = ["llama.modeling_llama.LlamaRMSNorm", "gemma.modeling_gemma.GemmaRMSNorm",
               "t5.modeling_t5.T5LayerNorm", "olmo2.modeling_olmo2.Olmo2RMSNorm",
               "gemma3.modeling_gemma3.Gemma3RMSNorm", "phi3.modeling_phi3.Phi3RMSNorm"]


@pytest.mark.parametrize("cls_path", RMS_CLASSES)
@pytest.mark.parametrize("xdt,wdt", [(torch.float32, torch.float32), (torch.float16, torch.float16),
                                     (torch.float16, torch.float32), (torch.float64, torch.float64),
                                     (torch.float32, torch.float64), (torch.bfloat16, torch.bfloat16),
                                     (torch.bfloat16, torch.float32)],
                         ids=["f32", "f16", "f16-w32", "f64", "f32-w64", "bf16", "bf16-w32"])
def test_each_form_matches_its_class(cls_path, xdt, wdt):
    """Output dtype the original's; values within two ulps of it (the kernel's statistics vs torch's)."""
    ref = _module(cls_path).to(wdt)
    ours = nt.replace_norms(copy.deepcopy(ref))
    g = torch.Generator().manual_seed(5)
    x = (torch.randn(6, 5, 48, generator=g, dtype=torch.float64) * torch.logspace(-3, 2, 5)[:, None]).to(xdt)
    x = x.requires_grad_()
    ya, yr = ours(x), ref(x)
    assert ya.dtype == yr.dtype
    ulp = torch.finfo(torch.float32 if yr.dtype == torch.float64 else yr.dtype).eps
    assert_close(ya, yr, 2 * ulp, "y")
    if yr.dtype in (torch.float16, torch.bfloat16):
        # rounding where the original rounds: only a tie flipped by the statistics' last
        # float32 bit differs (a cast misplaced changes about a quarter of the elements)
        assert (ya != yr).double().mean() < 0.01
    if xdt not in (torch.float16, torch.bfloat16):  # gradients through the kernel's backward against autograd's
        dy = torch.randn(ya.shape, generator=g, dtype=ya.dtype)
        ga = torch.autograd.grad((ya * dy).sum(), (x, ours.weight))
        gr = torch.autograd.grad((yr * dy).sum(), (x, ref.weight))
        for a, b, what in zip(ga, gr, ("dx", "dweight")):
            assert_close(a, b, 10 * F32, what)


def test_a_model_on_the_meta_device_is_replaced_as_on_the_cpu():
    """A model built on the meta device (its weights loaded later), and replaced there, inside
    ``with torch.device("meta")``, has its RMSNorms recognised as on the CPU (the probe runs
    on CPU stand-ins: meta tensors have no values), and once materialized they compute what
    the CPU model's do."""
    config = T.LlamaConfig(vocab_size=100, hidden_size=32, intermediate_size=64, num_hidden_layers=1,
                           num_attention_heads=4, num_key_value_heads=2, head_dim=8)
    with torch.device("meta"):
        meta = T.LlamaModel(config)
        # replaced where it is built: the probe's values and what its forward makes on the CPU
        # (its tensors, made on the meta device, raised "Cannot copy out of meta tensor")
        _, got = nt.replace_norms(meta, report=True)
    cpu = T.LlamaModel(config)
    _, want = nt.replace_norms(cpu, report=True)
    assert got == want and len(got.replaced) == 3 and got.left_alone == [], str(got)
    y = meta.norm(torch.empty(2, 5, 32, device="meta"))
    assert y.is_meta and y.shape == (2, 5, 32)
    meta.to_empty(device="cpu")
    meta.load_state_dict(cpu.state_dict())
    x = torch.randn(2, 5, 32)
    for path, _, _ in got.replaced:
        torch.testing.assert_close(meta.get_submodule(path)(x), cpu.get_submodule(path)(x), rtol=0, atol=0)


def test_left_alone_with_reasons_and_strict():
    from transformers.models.cohere.modeling_cohere import CohereLayerNorm
    from transformers.models.qwen3_next.modeling_qwen3_next import Qwen3NextRMSNormGated

    class Custom(torch.nn.LayerNorm):
        def forward(self, x):
            return super().forward(x) * 2

    class Scale(torch.nn.Module):  # weight and eps but not named or behaving like a norm: not reported
        def __init__(self):
            super().__init__()
            self.weight = torch.nn.Parameter(torch.ones(8))
            self.eps = 1e-6

        def forward(self, x):
            return x * self.weight + self.eps

    model = torch.nn.Sequential(torch.nn.Linear(8, 8), CohereLayerNorm(8), Qwen3NextRMSNormGated(8), Custom(8),
                                torch.nn.BatchNorm1d(8), Scale(), torch.nn.LayerNorm(8))
    before = [type(m) for m in model]
    with pytest.raises(ValueError, match="CohereLayerNorm") as err:
        nt.replace_norms(model, strict=True)
    assert "Qwen3NextRMSNormGated" in str(err.value) and "BatchNorm1d" in str(err.value)
    assert [type(m) for m in model] == before  # strict: nothing swapped
    out, report = nt.replace_norms(model, report=True)
    assert out is model and isinstance(model[6], nt.LayerNorm)
    assert [p for p, _, _ in report.replaced] == ["6"]
    why = {p: w for p, _, w in report.left_alone}
    assert set(why) == {"1", "2", "3", "4"}
    assert "none of the RMSNorm forms" in why["1"]  # subtracts the mean
    assert "takes more than the input (gate)" in why["2"]  # forward(x, gate)
    assert "forward of its own" in why["3"] and "batch" in why["4"]
    assert "left alone 4" in str(report)


class _GatedRMSNorm(torch.nn.Module):
    """Mamba-2's gated RMSNorm, as transformers writes it: without a gate, Llama's arithmetic."""

    def __init__(self, n, eps=1e-6):
        super().__init__()
        self.weight, self.variance_epsilon = torch.nn.Parameter(torch.ones(n)), eps

    def forward(self, hidden_states, gate=None):
        dtype = hidden_states.dtype
        h = hidden_states.to(torch.float32)
        if gate is not None:
            h = h * torch.nn.functional.silu(gate.to(torch.float32))
        h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + self.variance_epsilon)
        return self.weight * h.to(dtype)


class _CenteredRMSNorm(torch.nn.Module):
    """1 + weight rounded in the weight's dtype, then the product in float32: in float32 it is
    Gemma's form, in 16 bits another."""

    def __init__(self, n, eps=1e-6):
        super().__init__()
        self.weight, self.eps = torch.nn.Parameter(torch.zeros(n)), eps

    def forward(self, x):
        x32 = x.float()
        y = x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + self.eps)
        return (y * (1.0 + self.weight).float()).to(x.dtype)


class FrozenBatchNorm2d(torch.nn.Module):  # (as detection models write it: no torch.nn batch norm)
    def __init__(self, n, eps=1e-5):
        super().__init__()
        self.register_buffer("running_var", torch.ones(n))
        self.weight, self.eps = torch.nn.Parameter(torch.ones(n)), eps

    def forward(self, x):
        return x * (self.weight * (self.running_var + self.eps).rsqrt())[:, None, None]


class _WeightlessRMSNorm(torch.nn.Module):
    """Llama 4's query and key norm as transformers writes it: no weight."""

    def __init__(self, eps=1e-6):
        super().__init__()
        self.eps = eps

    def forward(self, x):
        return (x.float() * torch.rsqrt(x.float().pow(2).mean(-1, keepdim=True) + self.eps)).type_as(x)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16, torch.float64])
def test_a_weightless_rmsnorm_is_replaced_with_its_arithmetic(dtype):
    """A weightless RMSNorm class (Llama 4's query and key norm, NanoChat's) is replaced (it
    was left alone: "its parameters are not one 1-D weight"), over its input's last dimension
    whatever the width, its outputs the original's in its dtype, gradients autograd's; a
    module of no norm's name with an eps is not run."""
    class Shift(torch.nn.Module):  # an eps, no parameters, not a norm: not probed, not reported
        eps = 1e-6

        def forward(self, x):
            return x + self.eps

    model = torch.nn.Sequential(_WeightlessRMSNorm(), Shift())
    ref = copy.deepcopy(model)
    _, report = nt.replace_norms(model, report=True)
    assert [p for p, _, _ in report.replaced] == ["0"] and report.left_alone == [], str(report)
    assert "no weight" in report.replaced[0][2]
    g = torch.Generator().manual_seed(7)
    for width in (8, 48, 129):
        x = (torch.randn(3, 4, width, generator=g, dtype=torch.float64) * torch.logspace(-3, 2, 4)[:, None]).to(dtype)
        x.requires_grad_()
        got, want = model(x), ref(x)
        assert got.dtype == want.dtype == dtype
        ulp = torch.finfo(torch.float32 if dtype == torch.float64 else dtype).eps
        assert_close(got, want, 2 * ulp, "y")
        if dtype in (torch.float16, torch.bfloat16):
            assert (got != want).double().mean() < 0.01  # one rounding, where the original's is
        else:
            dy = torch.randn(got.shape, generator=g, dtype=dtype)
            assert_close(torch.autograd.grad((got * dy).sum(), x)[0], torch.autograd.grad((want * dy).sum(), x)[0],
                         10 * F32, "dx")


def test_what_a_replacement_could_not_compute_is_left_alone_and_parametrizations_are_no_norms():
    """A gated RMSNorm, whose gate the replacement's forward(x) would drop (a Mamba-2 model
    raised TypeError at its first forward); a form that only 16 bits tell from Gemma's (1 +
    weight rounded in the weight's dtype: a bfloat16 model's outputs moved by ulps in a
    quarter of the elements); a frozen batch norm, said to be one.  weight_norm's and
    spectral_norm's parametrizations are no norms of the model: strict=True passes."""
    gated, centered = _GatedRMSNorm(16), _CenteredRMSNorm(16)
    model = torch.nn.Sequential(gated, centered, FrozenBatchNorm2d(16))
    _, report = nt.replace_norms(model, report=True)
    why = {p: w for p, _, w in report.left_alone}
    assert report.replaced == [] and set(why) == {"0", "1", "2"}, str(report)
    assert "takes more than the input (gate)" in why["0"]
    assert "none of the RMSNorm forms" in why["1"] and "batch" in why["2"]
    x, g = torch.randn(2, 16), torch.randn(2, 16)
    torch.testing.assert_close(model[0](x, g), _GatedRMSNorm(16)(x, g), rtol=0, atol=0)
    parametrizations = torch.nn.utils.parametrizations
    model = torch.nn.Sequential(parametrizations.weight_norm(torch.nn.Linear(8, 8)),
                                parametrizations.spectral_norm(torch.nn.Linear(8, 8)), torch.nn.LayerNorm(8))
    _, report = nt.replace_norms(model, strict=True, report=True)
    assert [p for p, _, _ in report.replaced] == ["2"] and report.left_alone == [], str(report)
    model(torch.randn(3, 8)).sum().backward()


class _ChannelsFirstRMSNorm(torch.nn.Module):
    """An RMSNorm over the channels of (N, C, *spatial), as a ConvNeXt-like model writes it: on
    every 2-D probe it is the Gemma/OLMo-2 form."""

    def __init__(self, n, eps=1e-6):
        super().__init__()
        self.weight, self.eps = torch.nn.Parameter(torch.rand(n) + 0.5), eps

    def forward(self, x):
        x32 = x.float()
        y = x32 * torch.rsqrt(x32.pow(2).mean(1, keepdim=True) + self.eps)
        return (y * self.weight.float().view(1, -1, *[1] * (x.dim() - 2))).to(x.dtype)


def test_norms_holding_modules_are_reported_and_a_norm_over_another_axis_is_not_taken():
    """BiT's GroupNorm subclass holds its activation, and a parametrized LlamaRMSNorm its
    parametrizations: as modules with children both were walked into, neither replaced nor
    reported, and strict=True passed with them in place.  A norm over the channels passed
    the probe's 2-D rows as the last axis's, and was replaced: its outputs moved by 1.6 (or
    it raised at its first call).  A norm left alone still has its own norms replaced."""
    from torch.nn.utils import parametrize
    from transformers.models.bit.modeling_bit import BitGroupNormActivation
    from transformers.models.llama.modeling_llama import LlamaRMSNorm

    class Positive(torch.nn.Module):
        def forward(self, w):
            return torch.nn.functional.softplus(w)

    class Holding(torch.nn.LayerNorm):  # a norm of its own forward, holding one of torch's
        def __init__(self, n):
            super().__init__(n)
            self.inner = torch.nn.LayerNorm(n)

        def forward(self, x):
            return self.inner(super().forward(x))

    bit = BitGroupNormActivation(T.BitConfig(num_groups=4), 8)
    llama = LlamaRMSNorm(8)
    parametrize.register_parametrization(llama, "weight", Positive())
    model = torch.nn.Sequential(bit, llama, _ChannelsFirstRMSNorm(8), Holding(8), torch.nn.LayerNorm(8))
    with pytest.raises(ValueError, match="BitGroupNormActivation"):
        nt.replace_norms(model, strict=True)
    x = torch.randn(2, 8, 4, 8)
    ref = copy.deepcopy(model)
    _, report = nt.replace_norms(model, report=True)
    why = {p: w for p, _, w in report.left_alone}
    assert set(why) == {"0", "1", "2", "3"}, str(report)
    assert "forward of its own" in why["0"] and "parametrized" in why["1"] and "forward of its own" in why["3"]
    assert sorted(p for p, _, _ in report.replaced) == ["3.inner", "4"], str(report)
    assert isinstance(model[3].inner, nt.LayerNorm) and type(model[2]) is _ChannelsFirstRMSNorm
    for k in range(len(model) - 1):
        torch.testing.assert_close(model[k](x), ref[k](x))


# ------------------------------------------------------------ torch.compile

@pytest.mark.slow
def test_compile_fullgraph_whole_model():
    """A replaced Llama traces in one graph (the norms are custom operators), forward and backward."""
    ref = tiny("llama")
    ours = nt.replace_norms(copy.deepcopy(ref))
    torch._dynamo.reset()
    same_outputs_and_gradients(torch.compile(ours, fullgraph=True, backend="aot_eager"), ours, ref)


class EveryForm(torch.nn.Module):
    """One norm of each kind replace_norms produces, with linear layers between."""

    def __init__(self, d=32):
        super().__init__()
        self.norms = torch.nn.ModuleList([torch.nn.LayerNorm(d)] + [_module(c, d) for c in RMS_CLASSES[:4]])
        self.lins = torch.nn.ModuleList(torch.nn.Linear(d, d) for _ in self.norms)

    def forward(self, x):
        for norm, lin in zip(self.norms, self.lins):
            x = x + lin(norm(x))
        return x


@pytest.mark.slow
def test_compile_fullgraph_every_form_inductor():
    torch.manual_seed(0)
    ref = EveryForm()
    ours, report = nt.replace_norms(copy.deepcopy(ref), report=True)
    assert len(report.replaced) == 5
    torch._dynamo.reset()
    compiled = torch.compile(ours, fullgraph=True)
    x = torch.randn(2, 6, 32, generator=torch.Generator().manual_seed(1))
    xa, xr = x.clone().requires_grad_(), x.clone().requires_grad_()
    ya, yr = compiled(xa), ref(xr)
    assert_close(ya, yr, 10 * F32, "output")
    ya.sum().backward()
    yr.sum().backward()
    assert_close(xa.grad, xr.grad, 10 * F32, "dx")
    for (n, p), (_, q) in zip(ours.named_parameters(), ref.named_parameters()):
        assert_close(p.grad, q.grad, 10 * F32, n)


# ------------------------------------------------------------ the end-to-end benchmark

@pytest.mark.slow
def test_e2e_benchmark_runs_on_a_tiny_model(tmp_path):
    import json

    from benchmarks import e2e, readme_table

    out = tmp_path / "e2e.json"
    e2e.main(["--hidden", "32", "--intermediate", "64", "--layers", "1", "--heads", "4", "--kv-heads", "2",
              "--vocab", "64", "--prefill", "8", "--decode", "2", "--rounds", "1", "--dtypes", "float32",
              "--json", str(out)])
    run = json.loads(out.read_text())
    got = {(r["workload"], r["variant"]) for r in run["results"]}
    assert got == {(w, v) for w in ("prefill", "decode", "train") for v in e2e.VARIANTS}
    numba_rows = [r for r in run["results"] if r["variant"] == "numbanorm"]
    assert all(r["max rel. difference of logits vs torch"] < 1e-5 for r in numba_rows)
    assert all(0 < r["numbanorm op share (profile)"] < 1 for r in numba_rows)
    assert len(readme_table.e2e_rows(run)) == 3


def test_the_e2e_profile_share_is_read_from_a_profiled_call_after_a_profiled_warm_up():
    """numbanorm_share reads the share from a second profiled call: under the profiler
    numbanorm.torch takes its operator path, whose first use is slower and inflated the
    share (benchmarks/results/README.md, e2e-cpu.json)."""
    torch = pytest.importorskip("torch")
    from benchmarks import e2e

    seen = []

    def step():
        seen.append(torch.autograd.profiler._is_profiler_enabled)
        torch.ones(4).add_(1)

    assert e2e.numbanorm_share(step) == 0.0
    assert seen == [False, True, True]


def test_repository_readme_e2e_table_is_the_committed_results():
    from benchmarks import harness, readme_table

    run = harness.load_results(ROOT / "benchmarks" / "results" / "e2e-cpu.json")
    text = (ROOT / "README.md").read_text()
    assert readme_table.parse(text, readme_table.E2E_START, readme_table.E2E_END) == readme_table.e2e_rows(run)
