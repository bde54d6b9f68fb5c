"""Small real GGUF files of any tensor types, for the conversion tests (``test_gguf_streamed``).

``write_gguf`` writes a llama, qwen2 (q/k/v biases), qwen3 (q/k norms), gemma3 (q/k norms,
norms after attention and MLP, sliding-window layers), qwen2moe (experts stacked per layer,
a shared expert) or qwen3moe (q/k norms, experts stacked per layer, no shared one) model
with a byte-level BPE vocabulary, each tensor in the GGUF type
``types`` gives it (default: a Q4_K_M-like mix). The ``gguf``
package quantizes Q4_0, Q4_1, Q5_0, Q5_1 and Q8_0 but not the K-quants: ``quantize_q4_k``
and ``quantize_q6_k`` make valid blocks of those (simple encoders, not llama.cpp's search;
the tests check them against ``gguf.quants.dequantize``).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import numpy as np

from tests.artifacts.helpers import CHAT_TEMPLATE

# A chat template with Qwen3-Coder's tool markup (tools listed as XML in the system turn, calls
# as ``<function=NAME><parameter=P>`` blocks, results as ``<tool_response>``), written for the
# tests in the same shape as the model's own.
QWEN3_CODER_TEMPLATE = """\
{%- if tools %}<|im_start|>system
{% if messages[0].role == 'system' %}{{ messages[0].content }}

{% endif %}# Tools

You have access to the following functions:

<tools>
{%- for tool in tools %}{% set f = tool.function if tool.function is defined else tool %}
<function>
<name>{{ f.name }}</name>
<description>{{ f.description | default('') }}</description>
<parameters>
{%- for name, p in (f.parameters.properties | default({})) | items %}
<parameter>
<name>{{ name }}</name>
<type>{{ p.type | default('string') }}</type>
</parameter>
{%- endfor %}
</parameters>
</function>
{%- endfor %}
</tools>

If you choose to call a function ONLY reply in the following format:
<tool_call>
<function=example_function_name>
<parameter=example_parameter_1>
value_1
</parameter>
</function>
</tool_call><|im_end|>
{% elif messages[0].role == 'system' %}<|im_start|>system
{{ messages[0].content }}<|im_end|>
{% endif %}
{%- for m in messages %}
{%- if m.role == 'system' %}
{%- elif m.role == 'assistant' and m.tool_calls %}<|im_start|>assistant
{% if m.content %}{{ m.content }}
{% endif %}
{%- for tc in m.tool_calls %}{% set c = tc.function if tc.function is defined else tc %}<tool_call>
<function={{ c.name }}>
{% for k, v in c.arguments | items %}<parameter={{ k }}>
{{ v | tojson if v is mapping or (v is sequence and v is not string) else v | string }}
</parameter>
{% endfor %}</function>
</tool_call>{% endfor %}<|im_end|>
{% elif m.role == 'tool' %}<|im_start|>user
<tool_response>
{{ m.content }}
</tool_response><|im_end|>
{% else %}<|im_start|>{{ m.role }}
{{ m.content }}<|im_end|>
{% endif %}
{%- endfor %}
{%- if add_generation_prompt %}<|im_start|>assistant
{% endif %}"""

# A thinking model's template in the manner of Qwen3's thinking releases: the generation prompt
# opens the reasoning block, an assistant turn's ``reasoning_content`` is rendered back inside
# it, calls in Hermes markup.
THINKING_TEMPLATE = """\
{%- if tools %}<|im_start|>system
{% if messages[0].role == 'system' %}{{ messages[0].content }}

{% endif %}# Tools

<tools>
{%- for tool in tools %}
{{ tool | tojson }}
{%- endfor %}
</tools>

Call a function as <tool_call>
{"name": <function-name>, "arguments": <args-json-object>}
</tool_call><|im_end|>
{% elif messages[0].role == 'system' %}<|im_start|>system
{{ messages[0].content }}<|im_end|>
{% endif %}
{%- for m in messages %}
{%- if m.role == 'system' %}
{%- elif m.role == 'assistant' %}<|im_start|>assistant
{% if m.reasoning_content %}<think>
{{ m.reasoning_content.strip('\\n') }}
</think>

{% endif %}{{ m.content or '' }}
{%- for tc in m.tool_calls or [] %}
<tool_call>
{"name": "{{ tc.function.name }}", "arguments": {{ tc.function.arguments }}}
</tool_call>
{%- endfor %}<|im_end|>
{% elif m.role == 'tool' %}<|im_start|>user
<tool_response>
{{ m.content }}
</tool_response><|im_end|>
{% else %}<|im_start|>{{ m.role }}
{{ m.content }}<|im_end|>
{% endif %}
{%- endfor %}
{%- if add_generation_prompt %}<|im_start|>assistant
<think>
{% endif %}"""

# A template with the rules of Qwen3.5's (written here, not copied): the tools as JSON in the
# system turn ahead of the system prompt, calls in Qwen3-Coder's XML, a tool's results as a user
# turn of <tool_response> blocks, the generation prompt opening <think>, and an assistant turn's
# reasoning rendered back only after the last user question (and only when it has some, or is
# the last message) — so a new question changes how every earlier turn renders, the case that
# breaks prefix caches of hybrid models between agent turns.
QWEN35_TEMPLATE = """\
{%- set ns = namespace(last_query=messages | length - 1, tool_loop=true) %}
{%- for m in messages[::-1] %}
    {%- if ns.tool_loop and m.role == 'user' %}
        {%- set ns.tool_loop = false %}
        {%- set ns.last_query = messages | length - 1 - loop.index0 %}
    {%- endif %}
{%- endfor %}
{%- if tools %}
    {{- '<|im_start|>system\\n# Tools\\n\\nYou have access to the following functions:\\n\\n<tools>' }}
    {%- for tool in tools %}
        {{- '\\n' + (tool | tojson) }}
    {%- endfor %}
    {{- '\\n</tools>\\n\\nIf you choose to call a function ONLY reply in the following format with NO suffix:\\n\\n' }}
    {{- '<tool_call>\\n<function=example_function_name>\\n<parameter=example_parameter_1>\\nvalue_1\\n' }}
    {{- '</parameter>\\n</function>\\n</tool_call>' }}
    {%- if messages[0].role == 'system' %}
        {{- '\\n\\n' + messages[0].content }}
    {%- endif %}
    {{- '<|im_end|>\\n' }}
{%- elif messages[0].role == 'system' %}
    {{- '<|im_start|>system\\n' + messages[0].content + '<|im_end|>\\n' }}
{%- endif %}
{%- for m in messages %}
    {%- if m.role == 'assistant' %}
        {%- set reasoning = (m.reasoning_content or '') | trim %}
        {{- '<|im_start|>assistant\\n' }}
        {%- if loop.index0 > ns.last_query and (loop.last or reasoning) %}
            {{- '<think>\\n' + reasoning + '\\n</think>\\n\\n' }}
        {%- endif %}
        {{- (m.content or '') | trim }}
        {%- for tc in m.tool_calls or [] %}
            {%- set c = tc.function if tc.function is defined else tc %}
            {%- if not loop.first or m.content %}
                {{- '\\n\\n' }}
            {%- endif %}
            {{- '<tool_call>\\n<function=' + c.name + '>\\n' }}
            {%- for k, v in c.arguments | items %}
                {%- set text = v | tojson if v is mapping or (v is sequence and v is not string) else v | string %}
                {{- '<parameter=' + k + '>\\n' + text + '\\n</parameter>\\n' }}
            {%- endfor %}
            {{- '</function>\\n</tool_call>' }}
        {%- endfor %}
        {{- '<|im_end|>\\n' }}
    {%- elif m.role == 'tool' %}
        {%- if loop.first or messages[loop.index0 - 1].role != 'tool' %}
            {{- '<|im_start|>user' }}
        {%- endif %}
        {{- '\\n<tool_response>\\n' + m.content + '\\n</tool_response>' }}
        {%- if loop.last or messages[loop.index0 + 1].role != 'tool' %}
            {{- '<|im_end|>\\n' }}
        {%- endif %}
    {%- elif m.role != 'system' or not loop.first %}
        {{- '<|im_start|>' + m.role + '\\n' + m.content + '<|im_end|>\\n' }}
    {%- endif %}
{%- endfor %}
{%- if add_generation_prompt %}
    {{- '<|im_start|>assistant\\n<think>\\n' }}
{%- endif %}"""

# transformers reads neither expert size from a qwen2moe file: its config defaults.
MOE_FFN, MOE_SHARED_FFN = 1408, 5632


# gpt-oss's head size (64 in the real models: not the hidden size over the heads) and window.
GPT_OSS_HEAD_DIM = 32
GPT_OSS_WINDOW = 16


def q4_k_m_types(name: str) -> str:
    """A Q4_K_M-like mix: Q6_K for the output and every other layer's attn_v/ffn_down."""
    if name == "output.weight":
        return "Q6_K"
    if name.startswith("blk.") and name.split(".")[2] in ("attn_v", "ffn_down"):
        return "Q6_K" if int(name.split(".")[1]) % 2 == 0 else "Q4_K"
    return "Q4_K"


def write_gguf(path: Path, *, arch: str = "llama", seed: int = 0, hidden: int = 256, layers: int = 2, heads: int = 4,
               kv_heads: int = 2, ffn: int = 512, tied: bool = False, vocab_size: int | None = None, experts: int = 4,
               types: Callable[[str], str] | str = q4_k_m_types, head_scale: float = 0.05, expert_ffn: int = 256,
               experts_used: int = 2, context: int = 256, chat_template: str = CHAT_TEMPLATE,
               specials: Sequence[str] = (), eos: str = "<|im_end|>") -> Path:
    """A model of ``arch`` with random weights; ``types``: the GGUF type of each 2-D tensor
    (by GGUF name), or one type for all. Norms and biases are F32, as llama.cpp writes them.
    ``vocab_size``: rows of the embedding (default: the 264 tokens of the vocabulary);
    ``experts``: per MoE layer, ``experts_used`` of them routed a token, each of ``expert_ffn``
    (qwen3moe; qwen2moe's are transformers' defaults, ``MOE_FFN``); ``context``: the
    context length it declares; ``chat_template``: the one it carries; ``head_scale``: the
    deviation of the output matrix (the embedding if tied): random weights give near-uniform
    logits, a larger scale sharper ones, so that greedy tokens are no near-ties; ``specials``:
    more control tokens (gpt-oss's harmony ones), ``eos`` the one that ends generation. gpt-oss
    files split text as llama.cpp's ``gpt-4o`` pre-tokenizer does."""
    import gguf

    type_of = types if callable(types) else (lambda _: types)
    rng = np.random.default_rng(seed)
    vocabulary = gguf_vocab(specials)
    tokens = vocabulary[0]
    vocab = vocab_size or len(tokens)

    w = gguf.GGUFWriter(str(path), arch)
    w.add_name(f"{arch}-{seed}")
    w.add_context_length(context)
    w.add_embedding_length(hidden)
    w.add_block_count(layers)
    w.add_feed_forward_length(ffn if arch != "gpt-oss" else expert_ffn)  # llama.cpp's gpt-oss: the expert size
    w.add_head_count(heads)
    w.add_head_count_kv(kv_heads)
    w.add_rope_freq_base(10000.0)
    w.add_layer_norm_rms_eps(1e-6)
    w.add_rope_dimension_count(hidden // heads)
    head_dim = hidden // heads if arch != "gpt-oss" else GPT_OSS_HEAD_DIM
    if arch in ("qwen3", "qwen3moe", "gemma3", "gpt-oss"):  # their configs default to another head size
        w.add_key_length(head_dim)
        w.add_value_length(head_dim)
    if arch == "gemma3":
        w.add_sliding_window(64)
    if arch == "gpt-oss":
        w.add_sliding_window(GPT_OSS_WINDOW)
        w.add_rope_scaling_type(gguf.RopeScalingType.YARN)
        w.add_rope_scaling_factor(4.0)
        w.add_rope_scaling_orig_ctx_len(context // 4)
    w.add_vocab_size(vocab)
    if arch in ("qwen2moe", "qwen3moe", "gpt-oss"):
        w.add_expert_count(experts)
        w.add_expert_used_count(experts_used)
    if arch in ("qwen3moe", "gpt-oss"):
        w.add_expert_feed_forward_length(expert_ffn)
    add_gguf_tokenizer(w, vocabulary, pre="qwen2" if arch.startswith("qwen2") else "gpt-4o" if arch == "gpt-oss"
                       else "smollm", eos=eos, chat_template=chat_template)

    def tensor(name: str, shape: tuple[int, ...], scale: float = 0.05) -> None:
        data = (rng.standard_normal(shape) * scale).astype(np.float32)
        if len(shape) == 1:
            w.add_tensor(name, data)
            return
        kind = type_of(name)
        qtype = gguf.GGMLQuantizationType[kind]
        if kind in ("F32", "F16", "BF16"):
            w.add_tensor(name, gguf.quants.quantize(data, qtype) if kind != "F32" else data, raw_dtype=qtype)
        else:
            w.add_tensor(name, ENCODERS.get(kind, lambda x, t=qtype: gguf.quants.quantize(x, t))(data), raw_dtype=qtype)

    tensor("token_embd.weight", (vocab, hidden), head_scale if tied else 0.05)
    if arch == "gpt-oss":
        for i in range(layers):
            gpt_oss_layer(tensor, i, hidden, heads, kv_heads, experts, expert_ffn)
    for i in range(layers if arch != "gpt-oss" else 0):
        tensor(f"blk.{i}.attn_norm.weight", (hidden,))
        tensor(f"blk.{i}.attn_q.weight", (hidden, hidden))
        tensor(f"blk.{i}.attn_k.weight", (kv_heads * head_dim, hidden))
        tensor(f"blk.{i}.attn_v.weight", (kv_heads * head_dim, hidden))
        if arch.startswith("qwen2"):
            tensor(f"blk.{i}.attn_q.bias", (hidden,))
            tensor(f"blk.{i}.attn_k.bias", (kv_heads * head_dim,))
            tensor(f"blk.{i}.attn_v.bias", (kv_heads * head_dim,))
        if arch in ("qwen3", "qwen3moe", "gemma3"):
            tensor(f"blk.{i}.attn_q_norm.weight", (head_dim,))
            tensor(f"blk.{i}.attn_k_norm.weight", (head_dim,))
        tensor(f"blk.{i}.attn_output.weight", (hidden, hidden))
        tensor(f"blk.{i}.ffn_norm.weight", (hidden,))
        if arch == "gemma3":
            tensor(f"blk.{i}.post_attention_norm.weight", (hidden,))
            tensor(f"blk.{i}.post_ffw_norm.weight", (hidden,))
        if arch == "qwen2moe":
            tensor(f"blk.{i}.ffn_gate_inp.weight", (experts, hidden))
            tensor(f"blk.{i}.ffn_gate_exps.weight", (experts, MOE_FFN, hidden))
            tensor(f"blk.{i}.ffn_up_exps.weight", (experts, MOE_FFN, hidden))
            tensor(f"blk.{i}.ffn_down_exps.weight", (experts, hidden, MOE_FFN))
            tensor(f"blk.{i}.ffn_gate_inp_shexp.weight", (hidden,))
            tensor(f"blk.{i}.ffn_gate_shexp.weight", (MOE_SHARED_FFN, hidden))
            tensor(f"blk.{i}.ffn_up_shexp.weight", (MOE_SHARED_FFN, hidden))
            tensor(f"blk.{i}.ffn_down_shexp.weight", (hidden, MOE_SHARED_FFN))
            continue
        if arch == "qwen3moe":
            tensor(f"blk.{i}.ffn_gate_inp.weight", (experts, hidden), 0.5)  # routers that pick clear winners
            tensor(f"blk.{i}.ffn_gate_exps.weight", (experts, expert_ffn, hidden))
            tensor(f"blk.{i}.ffn_up_exps.weight", (experts, expert_ffn, hidden))
            tensor(f"blk.{i}.ffn_down_exps.weight", (experts, hidden, expert_ffn))
            continue
        tensor(f"blk.{i}.ffn_gate.weight", (ffn, hidden))
        tensor(f"blk.{i}.ffn_up.weight", (ffn, hidden))
        tensor(f"blk.{i}.ffn_down.weight", (hidden, ffn))
    tensor("output_norm.weight", (hidden,))
    if not tied:
        tensor("output.weight", (vocab, hidden), head_scale)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return path


def gpt_oss_layer(tensor: Callable[..., None], i: int, hidden: int, heads: int, kv_heads: int, experts: int,
                  expert_ffn: int) -> None:
    """A gpt-oss layer as llama.cpp writes it: attention with biases and a sink per head,
    routed experts with biases (gate and up de-interleaved into tensors of their own)."""
    q_dim, kv_dim = heads * GPT_OSS_HEAD_DIM, kv_heads * GPT_OSS_HEAD_DIM
    tensor(f"blk.{i}.attn_norm.weight", (hidden,))
    for name, rows in (("attn_q", q_dim), ("attn_k", kv_dim), ("attn_v", kv_dim)):
        tensor(f"blk.{i}.{name}.weight", (rows, hidden))
        tensor(f"blk.{i}.{name}.bias", (rows,))
    tensor(f"blk.{i}.attn_output.weight", (hidden, q_dim))
    tensor(f"blk.{i}.attn_output.bias", (hidden,))
    tensor(f"blk.{i}.attn_sinks.weight", (heads,), 1.0)
    tensor(f"blk.{i}.post_attention_norm.weight", (hidden,))
    tensor(f"blk.{i}.ffn_gate_inp.weight", (experts, hidden), 0.5)
    tensor(f"blk.{i}.ffn_gate_inp.bias", (experts,))
    inward, outward = (experts, expert_ffn, hidden), (experts, hidden, expert_ffn)
    for name, shape in (("ffn_gate_exps", inward), ("ffn_up_exps", inward), ("ffn_down_exps", outward)):
        tensor(f"blk.{i}.{name}.weight", shape, 0.5)
        tensor(f"blk.{i}.{name}.bias", shape[:2])


def gpt_oss_types(name: str) -> str:
    """What llama.cpp's gpt-oss GGUFs hold: MXFP4 experts, the rest Q8_0 (F32 the router)."""
    if name.endswith(".bias") or "ffn_gate_inp" in name:
        return "F32"
    return "MXFP4" if "_exps" in name else "Q8_0"


def quantize_q4_k(x: np.ndarray) -> np.ndarray:
    """``x [..., cols]`` (cols a multiple of 256) as Q4_K blocks: per 32-value sub-block
    ``x ~ q * d * sc - dmin * m`` with 4-bit q and 6-bit sc, m."""
    sub = x.reshape(-1, 8, 32).astype(np.float32)
    lo = np.minimum(sub.min(axis=-1), 0)
    step = (sub.max(axis=-1) - lo) / 15
    d = (step.max(axis=-1, keepdims=True) / 63).astype(np.float16)
    dmin = ((-lo).max(axis=-1, keepdims=True) / 63).astype(np.float16)
    with np.errstate(divide="ignore", invalid="ignore"):
        sc = np.nan_to_num(np.rint(step / d.astype(np.float32))).clip(0, 63).astype(np.uint8)
        mins = np.nan_to_num(np.rint(-lo / dmin.astype(np.float32))).clip(0, 63).astype(np.uint8)
        scale = (d.astype(np.float32) * sc)[..., None]
        q = np.nan_to_num(np.rint((sub + (dmin.astype(np.float32) * mins)[..., None]) / scale)).clip(0, 15)
    q = q.astype(np.uint8).reshape(-1, 4, 2, 32)
    qs = (q[:, :, 0] | (q[:, :, 1] << 4)).reshape(-1, 128)
    packed = np.empty((sub.shape[0], 12), np.uint8)
    packed[:, 0:4] = sc[:, :4] | ((sc[:, 4:] >> 4) << 6)
    packed[:, 4:8] = mins[:, :4] | ((mins[:, 4:] >> 4) << 6)
    packed[:, 8:12] = (sc[:, 4:] & 0xF) | ((mins[:, 4:] & 0xF) << 4)
    blocks = np.concatenate([d.view(np.uint8), dmin.view(np.uint8), packed, qs], axis=1)
    return blocks.reshape(*x.shape[:-1], -1)


def quantize_q6_k(x: np.ndarray) -> np.ndarray:
    """``x [..., cols]`` (cols a multiple of 256) as Q6_K blocks: per 16 values
    ``x ~ d * sc * (q - 32)`` with 6-bit q and int8 sc."""
    groups = x.reshape(-1, 16, 16).astype(np.float32)
    step = np.abs(groups).max(axis=-1) / 31
    d = (step.max(axis=-1, keepdims=True) / 127).astype(np.float16)
    with np.errstate(divide="ignore", invalid="ignore"):
        sc = np.nan_to_num(np.rint(step / d.astype(np.float32))).clip(0, 127).astype(np.int8)
        scale = (d.astype(np.float32) * sc)[..., None]
        q = np.nan_to_num(np.rint(groups / scale)).clip(-32, 31)
    q = (q + 32).astype(np.uint8).reshape(-1, 2, 4, 32)  # two halves of 128: four runs of 32
    ql = np.concatenate([q[:, :, 0] & 0xF | ((q[:, :, 2] & 0xF) << 4),
                         q[:, :, 1] & 0xF | ((q[:, :, 3] & 0xF) << 4)], axis=2).reshape(-1, 128)
    qh = (q[:, :, 0] >> 4 | ((q[:, :, 1] >> 4) << 2) | ((q[:, :, 2] >> 4) << 4) | ((q[:, :, 3] >> 4) << 6))
    blocks = np.concatenate([ql, qh.reshape(-1, 64), sc.view(np.uint8), d.view(np.uint8)], axis=1)
    return blocks.reshape(*x.shape[:-1], -1)


ENCODERS: dict[str, Callable[[np.ndarray], np.ndarray]] = {"Q4_K": quantize_q4_k, "Q6_K": quantize_q6_k}


def gguf_vocab(specials: Sequence[str] = ()) -> tuple[list[str], list[str], list[str]]:
    """``write_gguf``'s byte-level BPE vocabulary: (tokens, merges, control tokens)."""
    from transformers.convert_slow_tokenizer import bytes_to_unicode

    byte_chars = bytes_to_unicode()
    merges = ["h e", "l l", "o r", "Ġ t", "he ll"]
    control = ["<|endoftext|>", "<|im_start|>", "<|im_end|>", *specials]
    return [byte_chars[b] for b in range(256)] + [m.replace(" ", "") for m in merges] + control, merges, control


def add_gguf_tokenizer(w: Any, vocab: tuple[list[str], list[str], list[str]], *, pre: str, eos: str,
                       chat_template: str) -> None:
    """``gguf_vocab``'s vocabulary as a GGUF's tokenizer keys (llama.cpp's ``gpt2`` BPE with the
    ``pre`` pre-tokenizer), ``<|im_start|>`` its BOS, ``eos`` its end token."""
    tokens, merges, control = vocab
    w.add_tokenizer_model("gpt2")
    w.add_tokenizer_pre(pre)
    w.add_token_list(tokens)
    w.add_token_types([1] * (len(tokens) - len(control)) + [3] * len(control))  # 3: control (special)
    w.add_token_merges(merges)
    w.add_bos_token_id(tokens.index("<|im_start|>"))
    w.add_eos_token_id(tokens.index(eos))
    w.add_pad_token_id(tokens.index("<|im_end|>"))
    w.add_chat_template(chat_template)


def write_gemma4_gguf(path: Path, model: object, types: Callable[[str], str] | str = "F32",
                      chat_template: str = CHAT_TEMPLATE, specials: Sequence[str] = (),
                      eos: str = "<|im_end|>") -> Path:
    """A transformers Gemma 4 text model (``Gemma4ForCausalLM``, its vocabulary ``gguf_vocab``'s)
    written as llama.cpp's converter writes Gemma 4: its keys (head sizes and KV heads per
    layer kind, the sliding-window pattern, per-layer embeddings, shared KV layers, experts),
    the router's scale as ``ffn_gate_inp.scale`` and the per-expert scales as
    ``ffn_down_exps.scale``, experts' gate and up fused (``ffn_gate_up_exps``), a
    ``rope_freqs`` tensor that leaves the unrotated part of the global heads unrotated;
    ``types``: the GGUF type of each tensor of more than one dimension, by GGUF name."""
    import gguf
    import torch

    type_of = types if callable(types) else (lambda _: types)
    c = model.config  # type: ignore[attr-defined]
    tokens, merges, control = gguf_vocab(specials)
    assert c.vocab_size == len(tokens), "the model's vocabulary must be gguf_vocab's"
    swa = [t == "sliding_attention" for t in c.layer_types]
    layer = [c.per_layer_config[i] for i in range(c.num_hidden_layers)]  # heads and sizes per layer kind
    kv_heads, head_dim = layer[swa.index(True)].num_key_value_heads, layer[swa.index(True)].head_dim
    full_heads, full_dim = layer[swa.index(False)].num_key_value_heads, layer[swa.index(False)].head_dim
    w = gguf.GGUFWriter(str(path), "gemma4")
    w.add_name("gemma4-tiny")
    w.add_context_length(c.max_position_embeddings)
    w.add_embedding_length(c.hidden_size)
    w.add_block_count(c.num_hidden_layers)
    w.add_feed_forward_length(c.intermediate_size)
    w.add_head_count(c.num_attention_heads)
    w.add_head_count_kv([kv_heads if s else full_heads for s in swa])
    w.add_key_length(full_dim)
    w.add_value_length(full_dim)
    w.add_key_length_swa(head_dim)
    w.add_value_length_swa(head_dim)
    w.add_rope_dimension_count(full_dim)
    w.add_rope_dimension_count_swa(head_dim)
    w.add_rope_freq_base(c.rope_parameters["full_attention"]["rope_theta"])
    w.add_rope_freq_base_swa(c.rope_parameters["sliding_attention"]["rope_theta"])
    w.add_layer_norm_rms_eps(c.rms_norm_eps)
    w.add_sliding_window(c.sliding_window)
    w.add_sliding_window_pattern(swa)
    w.add_final_logit_softcapping(c.final_logit_softcapping)
    w.add_shared_kv_layers(c.num_kv_shared_layers)
    w.add_embedding_length_per_layer_input(c.hidden_size_per_layer_input or 0)
    if c.enable_moe_block:
        w.add_expert_count(c.num_experts)
        w.add_expert_used_count(c.top_k_experts)
        w.add_expert_feed_forward_length(c.moe_intermediate_size)
    w.add_vocab_size(len(tokens))
    add_gguf_tokenizer(w, (tokens, merges, control), pre="smollm", eos=eos, chat_template=chat_template)

    names = gguf.get_tensor_name_map(gguf.MODEL_ARCH.GEMMA4, c.num_hidden_layers)
    renamed = {".router.scale": ".ffn_gate_inp.scale", ".router.per_expert_scale": ".ffn_down_exps.scale"}
    for hf_name, value in model.state_dict().items():  # type: ignore[attr-defined]
        name = None
        for suffix, leaf in renamed.items():
            if hf_name.endswith(suffix):
                name = f"blk.{hf_name.split('.')[2]}{leaf}"
        if name is None:
            base = names.get_name(hf_name.removesuffix(".weight"))
            assert base is not None, hf_name
            name = base + ".weight"
        data = value.detach().to(torch.float32).numpy()
        if data.ndim == 1:
            w.add_tensor(name, data)
            continue
        kind = type_of(name)
        qtype = gguf.GGMLQuantizationType[kind]
        if kind == "F32":
            w.add_tensor(name, data)
        else:
            w.add_tensor(name, ENCODERS.get(kind, lambda x, t=qtype: gguf.quants.quantize(x, t))(data),
                         raw_dtype=qtype)
    full = c.rope_parameters["full_attention"]
    rotated = int(full_dim * full.get("partial_rotary_factor", 1.0) / 2)
    w.add_tensor("rope_freqs.weight", np.array([1.0] * rotated + [1e30] * (full_dim // 2 - rotated),
                                               dtype=np.float32))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return path


def write_qwen35_gguf(path: Path, model: Any, *, seed: int = 0, quantized: bool = False, mtp: bool = False,
                      chat_template: str = CHAT_TEMPLATE) -> Path:
    """``model`` (a small transformers ``Qwen3_5ForCausalLM`` or ``Qwen3_5MoeForCausalLM`` over
    ``write_gguf``'s 264-token vocabulary) as llama.cpp's converter writes Qwen3.5 and its MoE:
    architecture ``qwen35``/``qwen35moe``, its tensors under llama.cpp's names (F32; with
    ``quantized`` the matrices Q8_0 but for those llama.cpp keeps F32: the convolution and the
    routers; with ``mtp`` a multi-token-prediction block after the layers, as llama.cpp's newer
    converter writes it: ``blk.<layers>``, counted in ``block_count``), the
    zero-centred norms stored as ``w + 1`` (not the linear attention's gated norm), ``ssm_a`` as
    ``-exp(A_log)``, the convolution squeezed to 2-D, the value heads tiled (``v0k0 v0k1 v1k0
    ...``) where transformers groups them by key head, the routed experts' gate and up apart."""
    import gguf
    import torch

    cfg = model.config
    moe = hasattr(cfg, "num_experts")
    arch = "qwen35moe" if moe else "qwen35"
    k_heads, v_heads, v_dim = cfg.linear_num_key_heads, cfg.linear_num_value_heads, cfg.linear_value_head_dim
    per_key = v_heads // k_heads

    def tiled(rows: int) -> torch.Tensor:  # grouped row order -> llama.cpp's tiled one
        return torch.arange(k_heads * per_key * rows).reshape(k_heads, per_key, rows).transpose(0, 1).reshape(-1)

    vocabulary = gguf_vocab()
    tokens = vocabulary[0]
    assert cfg.vocab_size == len(tokens)
    w = gguf.GGUFWriter(str(path), arch)
    w.add_name(f"{arch}-{seed}")
    head_dim = cfg.head_dim
    rotary = int(head_dim * cfg.rope_parameters.get("partial_rotary_factor", 1.0))
    for key, value in {"context_length": cfg.max_position_embeddings, "embedding_length": cfg.hidden_size,
                       "block_count": cfg.num_hidden_layers + mtp, "nextn_predict_layers": int(mtp),
                       "attention.head_count": cfg.num_attention_heads,
                       "attention.head_count_kv": cfg.num_key_value_heads, "attention.key_length": head_dim,
                       "attention.value_length": head_dim, "rope.dimension_count": rotary,
                       "full_attention_interval": cfg.layer_types.index("full_attention") + 1,
                       "ssm.conv_kernel": cfg.linear_conv_kernel_dim, "ssm.state_size": cfg.linear_key_head_dim,
                       "ssm.group_count": k_heads, "ssm.time_step_rank": v_heads, "ssm.inner_size": v_heads * v_dim,
                       }.items():
        w.add_uint32(f"{arch}.{key}", int(value))
    if moe:
        for key, value in {"expert_count": cfg.num_experts, "expert_used_count": cfg.num_experts_per_tok,
                           "expert_feed_forward_length": cfg.moe_intermediate_size,
                           "expert_shared_feed_forward_length": cfg.shared_expert_intermediate_size}.items():
            w.add_uint32(f"{arch}.{key}", int(value))
    else:
        w.add_uint32(f"{arch}.feed_forward_length", cfg.intermediate_size)
    w.add_float32(f"{arch}.attention.layer_norm_rms_epsilon", cfg.rms_norm_eps)
    w.add_float32(f"{arch}.rope.freq_base", float(cfg.rope_parameters["rope_theta"]))
    half = rotary // 2  # M-RoPE sections over the rotated half: text positions rotate all axes alike
    w.add_array(f"{arch}.rope.dimension_sections", [half - 2 * (half // 3), half // 3, half // 3, 0])
    w.add_vocab_size(len(tokens))
    add_gguf_tokenizer(w, vocabulary, pre="qwen2", eos="<|im_end|>", chat_template=chat_template)

    def put(name: str, t: torch.Tensor) -> None:
        data = t.detach().float().contiguous().numpy()
        f32 = t.dim() < 2 or any(k in name for k in ("ssm_conv1d", "ffn_gate_inp", "norm"))
        if not quantized or f32:
            w.add_tensor(name, data)
        else:
            w.add_tensor(name, gguf.quants.quantize(data, gguf.GGMLQuantizationType.Q8_0),
                         raw_dtype=gguf.GGMLQuantizationType.Q8_0)

    inner = model.model
    put("token_embd.weight", inner.embed_tokens.weight)
    for i, layer in enumerate(inner.layers):
        b = f"blk.{i}"
        put(f"{b}.attn_norm.weight", layer.input_layernorm.weight + 1)
        put(f"{b}.post_attention_norm.weight", layer.post_attention_layernorm.weight + 1)
        if hasattr(layer, "linear_attn"):
            la = layer.linear_attn
            qk_rows = 2 * cfg.linear_key_head_dim * k_heads
            qkv = la.in_proj_qkv.weight
            put(f"{b}.attn_qkv.weight", torch.cat([qkv[:qk_rows], qkv[qk_rows:][tiled(v_dim)]]))
            conv = la.conv1d.weight.squeeze(1)
            put(f"{b}.ssm_conv1d.weight", torch.cat([conv[:qk_rows], conv[qk_rows:][tiled(v_dim)]]))
            put(f"{b}.attn_gate.weight", la.in_proj_z.weight[tiled(v_dim)])
            put(f"{b}.ssm_alpha.weight", la.in_proj_a.weight[tiled(1)])
            put(f"{b}.ssm_beta.weight", la.in_proj_b.weight[tiled(1)])
            put(f"{b}.ssm_a", -la.A_log.float().exp()[tiled(1)])
            put(f"{b}.ssm_dt.bias", la.dt_bias[tiled(1)])
            put(f"{b}.ssm_norm.weight", la.norm.weight)
            put(f"{b}.ssm_out.weight", la.out_proj.weight[:, tiled(v_dim)])
        else:
            at = layer.self_attn
            put(f"{b}.attn_q.weight", at.q_proj.weight)  # each head's query and output gate, as transformers has them
            put(f"{b}.attn_k.weight", at.k_proj.weight)
            put(f"{b}.attn_v.weight", at.v_proj.weight)
            put(f"{b}.attn_output.weight", at.o_proj.weight)
            put(f"{b}.attn_q_norm.weight", at.q_norm.weight + 1)
            put(f"{b}.attn_k_norm.weight", at.k_norm.weight + 1)
        mlp = layer.mlp
        if moe:
            inter = cfg.moe_intermediate_size
            put(f"{b}.ffn_gate_inp.weight", mlp.gate.weight)
            put(f"{b}.ffn_gate_exps.weight", mlp.experts.gate_up_proj[:, :inter])
            put(f"{b}.ffn_up_exps.weight", mlp.experts.gate_up_proj[:, inter:])
            put(f"{b}.ffn_down_exps.weight", mlp.experts.down_proj)
            put(f"{b}.ffn_gate_inp_shexp.weight", mlp.shared_expert_gate.weight.squeeze(0))
            put(f"{b}.ffn_gate_shexp.weight", mlp.shared_expert.gate_proj.weight)
            put(f"{b}.ffn_up_shexp.weight", mlp.shared_expert.up_proj.weight)
            put(f"{b}.ffn_down_shexp.weight", mlp.shared_expert.down_proj.weight)
        else:
            put(f"{b}.ffn_gate.weight", mlp.gate_proj.weight)
            put(f"{b}.ffn_up.weight", mlp.up_proj.weight)
            put(f"{b}.ffn_down.weight", mlp.down_proj.weight)
    if mtp:  # a few of the block's tensors: none of them is the served model's
        b = f"blk.{cfg.num_hidden_layers}"
        put(f"{b}.attn_norm.weight", torch.ones(cfg.hidden_size))
        put(f"{b}.attn_q.weight", torch.randn(cfg.num_attention_heads * head_dim * 2, cfg.hidden_size) * 0.05)
        if moe:
            put(f"{b}.ffn_down_exps.weight", torch.randn(cfg.num_experts, cfg.hidden_size, cfg.moe_intermediate_size))
        else:
            put(f"{b}.ffn_up.weight", torch.randn(cfg.intermediate_size, cfg.hidden_size) * 0.05)
    put("output_norm.weight", inner.norm.weight + 1)
    put("output.weight", model.lm_head.weight)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return path
