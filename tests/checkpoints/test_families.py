"""Each family of families.FAMILIES end to end, against transformers' own model class for it.

A tiny random model is built with the family's config class and saved with save_pretrained. minilade, loading those
files, must give transformers' logits in float64 for a prefill and for every row of a lookahead step (each row
compared with transformers run on the sequence that row stands for); greedy lookahead must emit autoregressive
output; and a GGUF written from the same weights as llama.cpp's converter writes it must load with logits within
its quantisation's error of the safetensors copy.
"""

from __future__ import annotations

import math
from pathlib import Path
from typing import Any, Callable

import gguf
import numpy as np
import pytest
import torch
import transformers
from gguf import GGMLQuantizationType as QType

from minilade.checkpoints import build_model, open_checkpoint
from minilade.checkpoints.families import FAMILIES
from minilade.decoding import Autoregressive, Lookahead
from minilade.invariance import apply_exact_attention
from minilade.masks import CandidateTree, LookaheadLayout, StepShape
from minilade.model import Transformer

from ..helpers import run_tokens

BASE = dict(vocab_size=24, hidden_size=64, intermediate_size=96, num_hidden_layers=2, num_attention_heads=4,
            num_key_value_heads=2, max_position_embeddings=128, rms_norm_eps=1e-5)
# name -> (config class, model class, GGUF architecture, config options). The Mistral window (5) is shorter than
# every text below and than a lookahead step's span of positions, so it hides committed keys and step keys.
VARIANTS: dict[str, tuple[Any, Any, str, dict[str, Any]]] = {
    "llama": (transformers.LlamaConfig, transformers.LlamaForCausalLM, "llama",
              dict(tie_word_embeddings=False, rope_theta=500000.0)),
    "mistral-window": (transformers.MistralConfig, transformers.MistralForCausalLM, "llama",
                       dict(sliding_window=5, tie_word_embeddings=False)),
    "qwen2-tied": (transformers.Qwen2Config, transformers.Qwen2ForCausalLM, "qwen2",
                   dict(tie_word_embeddings=True, rope_theta=1000000.0)),
    "qwen2-untied": (transformers.Qwen2Config, transformers.Qwen2ForCausalLM, "qwen2",
                     dict(tie_word_embeddings=False, rope_theta=1000000.0)),
}


def hf_model(variant: str, seed: int = 0, std: float = 0.3) -> Any:
    config_class, model_class, _, options = VARIANTS[variant]
    config = config_class(**BASE, **options)
    torch.manual_seed(seed)
    model = model_class(config).double().eval()
    with torch.no_grad():  # default init is too close to zero to tell implementations apart; biases random too
        for p in model.parameters():
            p.normal_(0.0, std)
    return model


@pytest.fixture(scope="module", params=list(VARIANTS))
def saved(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory) -> tuple[str, Any, Path]:
    """(variant, transformers model in float64, folder it was saved to)."""
    model = hf_model(request.param)
    folder = tmp_path_factory.mktemp(request.param)
    model.save_pretrained(folder)
    return request.param, model, folder


def load(folder: Path, dtype: torch.dtype = torch.float64) -> Transformer:
    """The model with the exact attention kernel, whose decoding steps lookahead's exactness rests on."""
    checkpoint = open_checkpoint(folder, progress=False)
    return apply_exact_attention(build_model(checkpoint.config, checkpoint.tensors(), dtype=dtype, device="cpu"))


def test_every_family_has_a_variant() -> None:
    assert {f.model_type for f in FAMILIES} == {VARIANTS[v][0].model_type for v in VARIANTS}


def test_config_reads_the_family(saved: tuple[str, Any, Path]) -> None:
    variant, hf, folder = saved
    config = open_checkpoint(folder, progress=False).config
    qwen = variant.startswith("qwen2")
    assert (config.qkv_bias, config.o_bias, config.mlp_bias) == (qwen, False, False)
    assert config.sliding_window == (5 if variant == "mistral-window" else 0)
    assert config.tie_word_embeddings == hf.config.tie_word_embeddings
    assert config.rope_theta == hf.config.rope_parameters["rope_theta"]


def test_prefill_logits_equal_transformers(saved: tuple[str, Any, Path]) -> None:
    _, hf, folder = saved
    ours = load(folder)
    tokens = torch.randint(0, 24, (2, 40), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        expected = hf(tokens).logits
        got = ours(tokens, torch.arange(40), ours.new_cache(64, batch_size=2))
    torch.testing.assert_close(got, expected, rtol=0, atol=1e-12)


def lookahead_step(prompt_length: int, seed: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """(prompt (P,), step tokens (T,), step mask (T, T), position offsets (T,)) of a window+candidates lookahead
    step (W=5, N=4: positions span 7 past the input token) with two candidates sharing their first token."""
    gen = torch.Generator().manual_seed(seed)
    prompt = torch.randint(0, 24, (prompt_length,), generator=gen)
    candidates = torch.randint(0, 24, (2, 3), generator=gen)
    candidates[1, 0] = candidates[0, 0]
    tree = CandidateTree.build(candidates)
    shape = StepShape(LookaheadLayout(5, 4, 2), with_window=True, device=torch.device("cpu"))
    mask, offsets, _ = shape.assemble(tree)
    tokens = torch.cat([torch.randint(0, 24, (shape.n_base,), generator=gen), tree.tokens])
    return prompt, tokens, mask, offsets


@pytest.mark.parametrize("prompt_length", [3, 20, 70])  # 70: past one 64-key chunk of invariant attention
def test_lookahead_step_rows_equal_transformers(saved: tuple[str, Any, Path], prompt_length: int) -> None:
    """Every row of a step with a custom mask gives the logits transformers gives for the last token of the
    sequence it stands for: the prompt, then the rows it sees in position order (its chain)."""
    _, hf, folder = saved
    ours = load(folder)
    prompt, tokens, mask, offsets = lookahead_step(prompt_length, seed=prompt_length)
    P = prompt.numel()
    with torch.no_grad():
        cache = ours.new_cache(P + tokens.numel())
        ours(prompt[None], torch.arange(P), cache)
        cache.commit(P)
        got = ours(tokens[None], P + offsets, cache, mask)[0]
        for row in range(tokens.numel()):
            chain = mask[row].nonzero().squeeze(1)
            chain = chain[offsets[chain].argsort()]
            assert torch.equal(offsets[chain], torch.arange(int(offsets[row]) + 1))  # a real sequence
            expected = hf(torch.cat([prompt, tokens[chain]])[None]).logits[0, -1]
            torch.testing.assert_close(got[row], expected, rtol=0, atol=1e-11, msg=f"row {row}")


def test_greedy_lookahead_equals_autoregressive(saved: tuple[str, Any, Path]) -> None:
    variant, _, folder = saved
    model = load(folder, torch.float32)
    gen = torch.Generator().manual_seed(5)
    accepted = 0
    for length in (1, 9, 30):
        prompt = torch.randint(0, 24, (length,), generator=gen).tolist()
        expected, _ = run_tokens(model, prompt, Autoregressive(), max_new_tokens=48)
        for strategy in (Lookahead(5, 4, 5), Lookahead(3, 3, 2, pool_from_prompt=False)):
            got, run = run_tokens(model, prompt, strategy, max_new_tokens=48)
            assert got == expected, (variant, length, strategy)
            accepted += run.stats.new_tokens - run.stats.forward_passes
    assert accepted > 0, "lookahead never accepted a candidate: the test would prove nothing"


# ---------------------------------------------------------------------------------------------------------------
# GGUF files of each family, written as llama.cpp's converter writes them
# ---------------------------------------------------------------------------------------------------------------

# Largest |logit difference| / largest |logit| allowed against the safetensors copy: about twice the largest
# measured over the four variants (weights of std 0.3 make the errors of two layers compound).
LOGIT_TOLERANCE = {QType.F32: 1e-6, QType.F16: 2e-3, QType.BF16: 2e-2, QType.Q8_0: 4e-2, QType.Q5_1: 0.3,
                   QType.Q5_0: 0.4, QType.Q4_1: 0.9, QType.Q4_0: 0.6}


def round_trip(tensor: torch.Tensor, qtype: QType) -> torch.Tensor:
    """What a GGUF of this type holds for an HF tensor, as float32: 1-D tensors are stored F32 (as llama.cpp)."""
    data = tensor.float().numpy()
    if tensor.ndim == 1 or qtype == QType.F32:
        return torch.from_numpy(data)
    if qtype == QType.F16:
        return torch.from_numpy(data.astype(np.float16).astype(np.float32))
    return torch.from_numpy(gguf.quants.dequantize(gguf.quants.quantize(data, qtype), qtype))


@pytest.mark.parametrize("qtype", list(LOGIT_TOLERANCE), ids=lambda q: q.name)
def test_gguf_logits_within_the_quantisation_error(saved: tuple[str, Any, Path], qtype: QType, tmp_path: Path,
                                                   gguf_tensors: Callable[..., Any], write_gguf: Callable[..., Path]
                                                   ) -> None:
    """Exactly the logits of the HF weights after the type's round trip (so names, metadata, the family's Q/K
    layout and biases are all right), and within the type's error of the unquantised logits."""
    variant, hf, folder = saved
    arch = VARIANTS[variant][2]
    window = {"sliding_window": hf.config.sliding_window} if variant == "mistral-window" else {}
    path = write_gguf(tmp_path / f"{variant}.gguf", hf.config, gguf_tensors(hf, qtype, arch), arch=arch, **window)
    checkpoint = open_checkpoint(path, progress=False)
    reference = open_checkpoint(folder, progress=False)
    same = dict(eos_token_ids=(), bos_token_id=None, norm_eps=reference.config.norm_eps)  # GGUF: float32 eps
    assert checkpoint.config.replace(**same) == reference.config.replace(**same)
    ours = build_model(checkpoint.config, checkpoint.tensors(), dtype=torch.float64, device="cpu")
    rounded = build_model(reference.config, ((n, round_trip(t, qtype)) for n, t in reference.tensors()),
                          dtype=torch.float64, device="cpu")
    unquantised = load(folder)
    tokens = torch.randint(0, 24, (1, 40), generator=torch.Generator().manual_seed(2))
    with torch.no_grad():
        got, want, exact = (model(tokens, torch.arange(40), model.new_cache(64))
                            for model in (ours, rounded, unquantised))
    torch.testing.assert_close(got, want, rtol=0, atol=1e-10)
    error = float((got - exact).abs().max() / exact.abs().max())
    assert error <= LOGIT_TOLERANCE[qtype], (variant, qtype.name, error)


def test_qwen2_gguf_rows_are_not_unpermuted(tmp_path: Path, gguf_tensors: Callable[..., Any],
                                            write_gguf: Callable[..., Path]) -> None:
    """A 'qwen2' file read as if it were permuted like a 'llama' file would run another model: the same weights
    written under both architectures must load to the same q/k rows."""
    hf = hf_model("qwen2-untied").float()
    rows = {}
    for arch in ("llama", "qwen2"):
        path = write_gguf(tmp_path / f"{arch}.gguf", hf.config, gguf_tensors(hf, QType.F32, arch), arch=arch)
        rows[arch] = dict(open_checkpoint(path, progress=False).tensors())
    for name in ("model.layers.0.self_attn.q_proj.weight", "model.layers.1.self_attn.k_proj.bias"):
        assert torch.equal(rows["llama"][name], rows["qwen2"][name]), name
        assert np.array_equal(rows["qwen2"][name].numpy(), hf.state_dict()[name].numpy()), name


def llama_cpp_rope_factors(theta: float, head_dim: int, factor: float, low: float, high: float, context: int
                           ) -> np.ndarray:
    """convert_hf_to_gguf.py's LlamaModel.generate_extra_tensors for rope_type llama3: one divisor per frequency."""
    freqs = 1.0 / (theta ** (torch.arange(0, head_dim, 2, dtype=torch.float32) / head_dim))
    factors = []
    for freq in freqs.tolist():
        wavelen = 2 * math.pi / freq
        if wavelen < context / high:
            factors.append(1.0)
        elif wavelen > context / low:
            factors.append(factor)
        else:
            smooth = (context / wavelen - low) / (high - low)
            factors.append(1 / ((1 - smooth) / factor + smooth))
    return np.array(factors, dtype=np.float32)


def test_llama3_gguf_rope_freqs_give_transformers_logits(tmp_path: Path, gguf_tensors: Callable[..., Any],
                                                         write_gguf: Callable[..., Path]) -> None:
    """A Llama 3.1-style model (llama3 rope scaling, original context 32 so that 100 positions feel it) as
    llama.cpp stores it: no scaling keys, a rope_freqs tensor instead. Its logits are transformers' up to the
    rounding of the factors (float32 division instead of HF's blend)."""
    rope = dict(rope_type="llama3", factor=8.0, low_freq_factor=1.0, high_freq_factor=4.0,
                original_max_position_embeddings=32)
    config = transformers.LlamaConfig(**BASE, rope_theta=500000.0, rope_scaling=rope)
    torch.manual_seed(0)
    hf = transformers.LlamaForCausalLM(config).double().eval()
    with torch.no_grad():
        for p in hf.parameters():
            p.normal_(0.0, 0.3)
    tensors = gguf_tensors(hf, QType.F32)
    factors = llama_cpp_rope_factors(500000.0, 16, 8.0, 1.0, 4.0, 32)
    tensors["rope_freqs.weight"] = (factors, None)
    checkpoint = open_checkpoint(write_gguf(tmp_path / "llama3.gguf", hf.config, tensors), progress=False)
    assert checkpoint.config.rope_scaling.kind == "default" and checkpoint.config.rope_freq_factors is not None
    ours = build_model(checkpoint.config, checkpoint.tensors(), dtype=torch.float64, device="cpu")
    plain = build_model(checkpoint.config.replace(rope_freq_factors=None), checkpoint.tensors(),
                        dtype=torch.float64, device="cpu")
    tokens = torch.randint(0, 24, (1, 100), generator=torch.Generator().manual_seed(3))
    with torch.no_grad():
        want = hf(tokens).logits
        got, unscaled = (m(tokens, torch.arange(100), m.new_cache(100)) for m in (ours, plain))
    error = float((got - want).abs().max() / want.abs().max())
    assert error < 1e-5, error
    assert float((unscaled - want).abs().max() / want.abs().max()) > 100 * error  # the factors do matter


@pytest.mark.parametrize("variant", ["mistral-window", "qwen2-tied"])
def test_from_transformers_equals_loading_the_same_weights_from_disk(variant: str, tmp_path: Path) -> None:
    """LLM.from_transformers reads the family from the loaded model's config as the loader reads config.json."""
    from minilade import LLM

    from ..helpers import write_tiny_checkpoint

    folder = write_tiny_checkpoint(tmp_path, "the cat sat on the mat and the dog sat on the log", max_positions=128)
    tokenizer = transformers.AutoTokenizer.from_pretrained(folder)
    config_class, model_class, _, options = VARIANTS[variant]
    torch.manual_seed(0)
    hf = model_class(config_class(**{**BASE, "vocab_size": len(tokenizer)}, **options)).eval()
    with torch.no_grad():
        for p in hf.parameters():
            p.normal_(0.0, 0.3)
    hf.save_pretrained(folder)
    bridged = LLM.from_transformers(hf, tokenizer)
    from_disk = LLM.load(folder, dtype="float32", device="cpu", progress=False, compile=False)
    assert bridged.model.config == from_disk.model.config
    want = from_disk.generate("the cat sat", max_new_tokens=24, strategy=Lookahead(3, 3, 2))
    got = bridged.generate("the cat sat", max_new_tokens=24, strategy=Lookahead(3, 3, 2))
    assert got.token_ids == want.token_ids
