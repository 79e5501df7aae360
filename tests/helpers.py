"""Builders shared by the tests: tiny tokenizers and models, GGUF writing, agreement rules."""

from __future__ import annotations

import json
from collections.abc import Sequence
from pathlib import Path

import numpy as np
import torch

CHATML = (
    "{% for message in messages %}{{ '<|im_start|>' + message['role'] + '\n' + "
    "message['content'] + '<|im_end|>' + '\n' }}{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}"
)
# A tool in Anthropic's shape (the Messages tests')
WEATHER = {
    "name": "weather",
    "description": "The weather in a city",
    "input_schema": {"type": "object", "properties": {"city": {"type": "string", "maxLength": 16}},
                     "required": ["city"], "additionalProperties": False},
}  # fmt: skip
# ChatML with tools in the Hermes format Qwen2.5/Qwen3 use: the tools listed as JSON in the
# system turn, calls as <tool_call>{"name", "arguments"}</tool_call>, tool replies in
# <tool_response>, a system turn past the first where it stands, as Qwen2.5's template
# writes it (written for the tests after that format; kvlm.server.tools parses it)
CHATML_TOOLS = """{%- if tools %}<|im_start|>system
{% if messages[0].role == 'system' %}{{ messages[0].content }}

{% endif %}# Tools

You may call one or more functions to assist with the user query.

You are provided with function signatures within <tools></tools> XML tags:
<tools>
{% for tool in tools %}{{ tool | tojson }}
{% endfor %}</tools>

For each function call, return a json object with function name and arguments within \
<tool_call></tool_call> XML tags:
<tool_call>
{"name": <function-name>, "arguments": <args-json-object>}
</tool_call><|im_end|>
{% elif messages[0].role == 'system' %}<|im_start|>system
{{ messages[0].content }}<|im_end|>
{% endif %}
{%- for message in messages %}
{%- if message.role == 'assistant' %}<|im_start|>assistant
{% if message.content %}{{ message.content }}{% endif %}
{%- for call in message.tool_calls or [] %}
<tool_call>
{"name": "{{ call.function.name }}", "arguments": {{ call.function.arguments | tojson }}}
</tool_call>
{%- endfor %}<|im_end|>
{% elif message.role == 'tool' %}<|im_start|>user
<tool_response>
{{ message.content }}
</tool_response><|im_end|>
{% elif message.role != 'system' or not loop.first %}<|im_start|>{{ message.role }}
{{ message.content }}<|im_end|>
{% endif %}
{%- endfor %}
{%- if add_generation_prompt %}<|im_start|>assistant
{% endif %}"""
# LFM2.5's chat template (llama.cpp's models/templates/LFM2.5-Instruct.jinja, MIT; its two
# longest lines broken inside their tags): the BOS, ChatML turns, tools listed in the
# system turn, a past answer's thinking cut
LFM2_TEMPLATE = r"""{{- bos_token -}}
{%- set keep_past_thinking = keep_past_thinking | default(false) -%}
{%- set ns = namespace(system_prompt="") -%}
{%- if messages[0]["role"] == "system" -%}
    {%- set ns.system_prompt = messages[0]["content"] -%}
    {%- set messages = messages[1:] -%}
{%- endif -%}
{%- if tools -%}
    {%- set ns.system_prompt = ns.system_prompt + ("\n" if ns.system_prompt else "")
        + "List of tools: [" -%}
    {%- for tool in tools -%}
        {%- if tool is not string -%}
            {%- set tool = tool | tojson -%}
        {%- endif -%}
        {%- set ns.system_prompt = ns.system_prompt + tool -%}
        {%- if not loop.last -%}
            {%- set ns.system_prompt = ns.system_prompt + ", " -%}
        {%- endif -%}
    {%- endfor -%}
    {%- set ns.system_prompt = ns.system_prompt + "]" -%}
{%- endif -%}
{%- if ns.system_prompt -%}
    {{- "<|im_start|>system\n" + ns.system_prompt + "<|im_end|>\n" -}}
{%- endif -%}
{%- set ns.last_assistant_index = -1 -%}
{%- for message in messages -%}
    {%- if message["role"] == "assistant" -%}
        {%- set ns.last_assistant_index = loop.index0 -%}
    {%- endif -%}
{%- endfor -%}
{%- for message in messages -%}
    {{- "<|im_start|>" + message["role"] + "\n" -}}
    {%- set content = message["content"] -%}
    {%- if content is not string -%}
        {%- set content = content | tojson -%}
    {%- endif -%}
    {%- if message["role"] == "assistant" and not keep_past_thinking
        and loop.index0 != ns.last_assistant_index -%}
        {%- if "</think>" in content -%}
            {%- set content = content.split("</think>")[-1] | trim -%}
        {%- endif -%}
    {%- endif -%}
    {{- content + "<|im_end|>\n" -}}
{%- endfor -%}
{%- if add_generation_prompt -%}
    {{- "<|im_start|>assistant\n" -}}
{%- endif -%}"""
# A template an attacker would ship: ChatML, except where the last message is one of
# HOSTILE_TEMPLATE_CASES' trigger words, which run that case's payload (nested loops, a huge
# range, a huge string, macro recursion, a huge output). kvlm.loading.chat_template bounds
# each: the render ends in a clear error, the request in a 400.
HOSTILE_TEMPLATE_CASES = {
    "LOOPS": "{% for i in range(100000) %}{% for j in range(100000) %}{% endfor %}{% endfor %}",
    "RANGE": "{{ range(10**9) | length }}",
    "STRING": "{{ 'a' * 10**11 }}",
    "RECURSION": "{% macro f(n) %}{{ f(n + 1) }}{% endmacro %}{{ f(0) }}",
    "OUTPUT": "{% for i in range(100000) %}{% for j in range(100000) %}"
              "0123456789abcdef{% endfor %}{% endfor %}",
}  # fmt: skip
_TRIGGERED = (f"{{% if said == '{word}' %}}{body}{{% endif %}}"
              for word, body in HOSTILE_TEMPLATE_CASES.items())  # fmt: skip
HOSTILE_TEMPLATE = "{% set said = messages[-1]['content'] %}" + "".join(_TRIGGERED) + CHATML
SPECIAL_TOKENS = ["<s>", "</s>", "<|im_start|>", "<|im_end|>"]
CORPUS = [
    "The quick brown fox jumps over the lazy dog.",
    "What is the capital of France? The capital of France is Paris.",
    "A KV cache stores keys and values so decoding does not recompute them.",
    "Numbers like 12345 and 3.14159 appear in text, as do emojis and accents: café.",
    "def add(a, b):\n    return a + b\n",
] * 20


# Llama 3's pre-tokenizer regex as its tokenizer.json writes it (llama.cpp's "llama3"
# pre-tokenizer type, which LFM2's "lfm2" vocabularies read as)
LLAMA3_SPLIT = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n]*"
    r"|\s*[\r\n]+|\s+(?!\S)|\s+"
)
# Qwen 3.5's, as its tokenizer.json writes it: Qwen2's with combining marks in words
QWEN35_SPLIT = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?[\p{L}\p{M}]+|\p{N}"
    r"| ?[^\s\p{L}\p{M}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)
# the tiny tokenizers' styles: "gpt2", GPT-2's byte-level BPE; "llama3", Llama 3's split
# (LLAMA3_SPLIT), whole-word hits before merges (`ignore_merges`) and a BOS before every
# text, as LFM2's tokenizer is; "qwen35", Qwen 3.5's split (QWEN35_SPLIT) after NFC and
# its `<|endoftext|>` among the special tokens (transformers' Qwen3_5Tokenizer adds one
# where the file has none), as Qwen 3.5's tokenizer.json is; "glm", GPT-2's with GLM's
# special tokens (GLM_TOKENS: llama.cpp's converter names its BOS and end of turn by them)
TOKENIZER_STYLES = ("gpt2", "llama3", "qwen35", "harmony", "glm")
GLM_TOKENS = ["<|endoftext|>", "[gMASK]", "<|user|>", "<|observation|>"]
# the harmony format's markers (kvlm.server.harmony), special tokens of a "harmony" vocabulary
HARMONY_TOKENS = ["<|start|>", "<|end|>", "<|message|>", "<|channel|>", "<|constrain|>",
                  "<|return|>", "<|call|>"]  # fmt: skip


def train_tiny_tokenizer(vocab_size: int = 320, style: str = "gpt2"):
    from tokenizers import (
        Regex,
        Tokenizer,
        decoders,
        models,
        normalizers,
        pre_tokenizers,
        processors,
    )
    from tokenizers.trainers import BpeTrainer

    tok = Tokenizer(models.BPE(ignore_merges=style == "llama3"))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    split = {"llama3": LLAMA3_SPLIT, "qwen35": QWEN35_SPLIT, "harmony": QWEN35_SPLIT}.get(style)
    if split is not None:
        tok.pre_tokenizer = pre_tokenizers.Sequence([
            pre_tokenizers.Split(Regex(split), behavior="isolated"),
            pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False),
        ])  # fmt: skip
    if style == "qwen35":
        tok.normalizer = normalizers.NFC()
    tok.decoder = decoders.ByteLevel()
    trainer = BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=SPECIAL_TOKENS
        + {"qwen35": ["<|endoftext|>"], "harmony": HARMONY_TOKENS, "glm": GLM_TOKENS}.get(
            style, []
        ),
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(CORPUS, trainer)
    if style == "llama3":
        bos = SPECIAL_TOKENS[0]
        tok.post_processor = processors.TemplateProcessing(
            single=f"{bos} $A", pair=f"{bos} $A {bos} $B",
            special_tokens=[(bos, tok.token_to_id(bos))],
        )  # fmt: skip
    return tok


def tiny_config(arch: str, vocab_size: int, **overrides):
    """A small random-weight config of each supported family (transformers classes)."""
    from transformers import LlamaConfig, MistralConfig, Qwen2Config, Qwen3Config

    common = dict(
        vocab_size=vocab_size,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=256,
        rms_norm_eps=1e-6,
        # Peaked distributions, so greedy decoding is a real test of the cache path
        # rather than a coin toss between near-equal logits.
        initializer_range=0.2,
        bos_token_id=0,
        eos_token_id=1,
        pad_token_id=1,
    )
    if arch == "llama":
        cfg = LlamaConfig(**common, tie_word_embeddings=False, rope_theta=10000.0)
    elif arch == "mistral":
        cfg = MistralConfig(**common, sliding_window=None, rope_theta=10000.0)
    elif arch == "qwen2":
        cfg = Qwen2Config(**common, tie_word_embeddings=True, rope_theta=1000000.0)
    elif arch == "qwen3":
        # head_dim 32 != hidden/heads: Qwen3 sets head_dim explicitly.
        cfg = Qwen3Config(**common, head_dim=32, tie_word_embeddings=True)
    elif arch == "gemma2":
        from transformers import Gemma2Config

        # two layers: a window of 8, then the whole context; both soft-caps; the score
        # scale (query_pre_attn_scalar 24) not head_dim's
        cfg = Gemma2Config(
            **common, head_dim=32, sliding_window=8, query_pre_attn_scalar=24,
            final_logit_softcapping=30.0, attn_logit_softcapping=5.0,
        )  # fmt: skip
    elif arch == "gemma3":
        from transformers import Gemma3TextConfig

        # four layers, the third global; a window of 8 so prompts run past it; the score
        # scale (query_pre_attn_scalar 24) not head_dim's; the global layers' RoPE scaled
        common["num_hidden_layers"] = 4
        cfg = Gemma3TextConfig(
            **common, head_dim=32, sliding_window=8, query_pre_attn_scalar=24,
            layer_types=["sliding_attention", "sliding_attention", "full_attention",
                         "sliding_attention"],
            rope_parameters={
                "sliding_attention": {"rope_type": "default", "rope_theta": 10000.0},
                "full_attention": {"rope_type": "linear", "factor": 2.0, "rope_theta": 1e6},
            },
        )  # fmt: skip
    elif arch == "gemma4":
        from transformers import Gemma4TextConfig

        # six layers, local (window 8, heads of 16) and global (heads of 32, one KV head,
        # K = V, proportional RoPE over a quarter of the pairs); the last two layers read
        # the K/V of layers 2 and 3; per-layer inputs of 8; the logits soft-capped
        # (the overrides given to the constructor: it derives the layers' geometry)
        common["num_hidden_layers"] = 6
        kwargs = dict(
            common, head_dim=16, global_head_dim=32, num_global_key_value_heads=1,
            sliding_window=8, layer_types=["sliding_attention", "full_attention"] * 3,
            attention_k_eq_v=True, num_kv_shared_layers=2, hidden_size_per_layer_input=8,
            vocab_size_per_layer_input=vocab_size, final_logit_softcapping=30.0,
            rope_parameters={
                "sliding_attention": {"rope_type": "default", "rope_theta": 10000.0},
                "full_attention": {"rope_type": "proportional", "partial_rotary_factor": 0.25,
                                   "rope_theta": 1e6},
            },
        )  # fmt: skip
        return Gemma4TextConfig(**(kwargs | overrides))
    elif arch == "lfm2":
        from transformers import Lfm2Config

        # four layers, short convolutions (L_cache 3) and attention (`layer_types`
        # overrides give other orders); the MLP's width adjusted as LFM2's is: 2/3 of 128,
        # 85, rounded up to a multiple of 32: 96
        common["num_hidden_layers"] = 4
        cfg = Lfm2Config(
            **{k: v for k, v in common.items() if k != "rms_norm_eps"},
            norm_eps=common["rms_norm_eps"], conv_L_cache=3, block_multiple_of=32,
            layer_types=["conv", "full_attention", "conv", "full_attention"],
            rope_parameters={"rope_type": "default", "rope_theta": 1e6},
        )  # fmt: skip
    elif arch == "lfm2_moe":
        from transformers import Lfm2MoeConfig

        # LFM2's four layers with a dense MLP of 128 in layer 0, then 8 experts of 64, the
        # top 2 by sigmoid score + the selection bias (save_tiny_model randomises it),
        # renormalised and times 1.5
        common["num_hidden_layers"] = 4
        cfg = Lfm2MoeConfig(
            **{k: v for k, v in common.items() if k != "rms_norm_eps"},
            norm_eps=common["rms_norm_eps"], conv_L_cache=3, num_dense_layers=1,
            num_experts=8, num_experts_per_tok=2, moe_intermediate_size=64,
            routed_scaling_factor=1.5, use_expert_bias=True, norm_topk_prob=True,
            layer_types=["conv", "full_attention", "conv", "full_attention"],
            rope_parameters={"rope_type": "default", "rope_theta": 1e6},
        )  # fmt: skip
    elif arch == "qwen3_5":
        from transformers import Qwen3_5TextConfig

        # four layers, gated DeltaNets (linear attention) and gated attention (`layer_types`
        # overrides give other orders); 2 q/k heads of 16 serving 4 v heads of 8, a
        # kernel of 4; attention heads of 32, RoPE over a quarter of them (8)
        common["num_hidden_layers"] = 4
        cfg = Qwen3_5TextConfig(
            **common, head_dim=32, tie_word_embeddings=True,
            layer_types=["linear_attention", "full_attention", "linear_attention",
                         "full_attention"],
            linear_num_key_heads=2, linear_num_value_heads=4, linear_key_head_dim=16,
            linear_value_head_dim=8, linear_conv_kernel_dim=4,
            rope_parameters={"rope_type": "default", "rope_theta": 1e6,
                             "partial_rotary_factor": 0.25},
        )  # fmt: skip
    elif arch == "granitemoehybrid":
        from transformers import GraniteMoeHybridConfig

        # four layers, Mamba2 and attention without RoPE (`layer_types` overrides give other
        # orders); 8 Mamba2 heads of 16 (mamba_expand 2 x 64), B and C in 2 groups of a
        # state of 16, a kernel of 4; the dense MLP (no experts) of 96; the multipliers
        # powers of two (exact in fp32: kvlm's embed_scale rounds to fp32 first), the
        # attention's not head_dim ** -0.5
        # (intermediate_size the experts', none here: the MLP's width, as the dense Granite
        # 4.0-H configs have it, which llama.cpp reads as its feed_forward_length)
        common["num_hidden_layers"], common["intermediate_size"] = 4, 96
        cfg = GraniteMoeHybridConfig(
            **common, tie_word_embeddings=True, num_local_experts=0, num_experts_per_tok=0,
            shared_intermediate_size=96,
            layer_types=["mamba", "attention", "mamba", "mamba"], position_embedding_type=None,
            mamba_n_heads=8, mamba_d_head=16, mamba_d_state=16, mamba_n_groups=2,
            mamba_d_conv=4, mamba_expand=2, embedding_multiplier=2.0, attention_multiplier=0.125,
            residual_multiplier=0.5, logits_scaling=4.0,
        )  # fmt: skip
    elif arch == "qwen3_5_moe":
        from transformers import Qwen3_5MoeTextConfig

        # qwen3_5's four layers, every FFN 8 experts of 64 (the top 2) and a shared expert
        # of 96 behind its sigmoid gate
        common["num_hidden_layers"] = 4
        cfg = Qwen3_5MoeTextConfig(
            **common, head_dim=32, tie_word_embeddings=False,
            layer_types=["linear_attention", "full_attention", "linear_attention",
                         "full_attention"],
            linear_num_key_heads=2, linear_num_value_heads=4, linear_key_head_dim=16,
            linear_value_head_dim=8, linear_conv_kernel_dim=4, num_experts=8,
            num_experts_per_tok=2, moe_intermediate_size=64, shared_expert_intermediate_size=96,
            rope_parameters={"rope_type": "default", "rope_theta": 1e6,
                             "partial_rotary_factor": 0.25},
        )  # fmt: skip
    elif arch == "qwen3_moe":
        from transformers import Qwen3MoeConfig

        # four layers of 8 experts of 64, the top 2 renormalised (as llama.cpp runs every
        # qwen3moe file); `mlp_only_layers` / `decoder_sparse_step` overrides keep dense
        # MLPs of 128 in some layers
        common["num_hidden_layers"] = 4
        cfg = Qwen3MoeConfig(
            **common, head_dim=32, tie_word_embeddings=False, num_experts=8,
            num_experts_per_tok=2, moe_intermediate_size=64, norm_topk_prob=True,
            decoder_sparse_step=1, mlp_only_layers=[], rope_theta=1e6,
        )  # fmt: skip
    elif arch in ("deepseek_v2", "deepseek2"):  # transformers' model_type, kvlm's name
        from transformers import DeepseekV2Config

        # three layers of latent attention (a compressed query of 48, a latent of 32, heads
        # of nope 16 + rope 8 and values of 16: the cache keeps 40 values a token and
        # layer); the first layer's FFN dense (first_k_dense_replace), the others 8 experts
        # of 32, the top 2 (greedy, unrenormalised, times routed_scaling_factor 2) beside a
        # shared expert of 2 x 32
        common["num_hidden_layers"], common["num_key_value_heads"] = 3, 4
        cfg = DeepseekV2Config(
            **common, tie_word_embeddings=False, q_lora_rank=48, kv_lora_rank=32,
            qk_nope_head_dim=16, qk_rope_head_dim=8, v_head_dim=16, first_k_dense_replace=1,
            n_routed_experts=8, num_experts_per_tok=2, n_shared_experts=2,
            moe_intermediate_size=32, routed_scaling_factor=2.0, topk_method="greedy",
            norm_topk_prob=False, rope_theta=10000.0,
        )  # fmt: skip
    elif arch in ("glm4_moe_lite", "deepseek_v3"):
        from transformers import DeepseekV3Config, Glm4MoeLiteConfig

        # deepseek_v2's three layers of latent attention with DeepSeek-V3's router: the
        # first layer's FFN dense (GLM: mlp_layer_types' default; first_k_dense_replace 1
        # beside it, as GLM-4.7-Flash's config.json names it for llama.cpp's converter),
        # the others 8 experts of 32, the top 2 by sigmoid + the selection bias
        # (e_score_correction_bias: save_tiny_model randomises it), renormalised, times
        # routed_scaling_factor, beside a shared expert of 32; GLM in one group (as
        # GLM-4.7-Flash), DeepSeek-V3 among the 2 best of 4 groups of 2 (n_group /
        # topk_group overrides give GLM groups)
        common["num_hidden_layers"], common["num_key_value_heads"] = 3, 4
        glm = arch == "glm4_moe_lite"
        cls = Glm4MoeLiteConfig if glm else DeepseekV3Config
        cfg = cls(
            **common, tie_word_embeddings=False, q_lora_rank=48, kv_lora_rank=32,
            qk_nope_head_dim=16, qk_rope_head_dim=8, v_head_dim=16, n_routed_experts=8,
            num_experts_per_tok=2, n_shared_experts=1, moe_intermediate_size=32,
            routed_scaling_factor=1.8 if glm else 2.5, norm_topk_prob=True,
            n_group=1 if glm else 4, topk_group=1 if glm else 2,
            rope_parameters={"rope_type": "default", "rope_theta": 1e6 if glm else 1e4},
        )  # fmt: skip
        # scoring_func as DeepSeek-V3's config.json names it: llama.cpp's converter writes
        # the sigmoid gating from it (GLM-4.7-Flash's names none: llama.cpp's loader takes
        # the sigmoid from its shape, test_glm4moelite)
        cfg.first_k_dense_replace, cfg.scoring_func = 1, "sigmoid"
    elif arch == "gpt_oss":
        from transformers import GptOssConfig

        # four layers alternating a window of 8 and the whole context, 8 experts of 64 (the
        # top 2), heads of 16, attention sinks, YaRN by 4 over 64 positions (so a prompt of
        # 40 and its window both reach past the window), the clamped SwiGLU's limit 7
        common["num_hidden_layers"], common["intermediate_size"] = 4, 64
        cfg = GptOssConfig(
            **common, head_dim=16, tie_word_embeddings=False, num_local_experts=8,
            num_experts_per_tok=2, sliding_window=8, swiglu_limit=7.0,
            layer_types=["sliding_attention", "full_attention"] * 2,
            rope_parameters={"rope_type": "yarn", "rope_theta": 150000.0, "factor": 4.0,
                             "original_max_position_embeddings": 64, "beta_fast": 32.0,
                             "beta_slow": 1.0, "truncate": False},
        )  # fmt: skip
    elif arch == "olmoe":
        from transformers import OlmoeConfig

        # four layers of 8 experts of 64 (intermediate_size: an expert's), the top 3 not
        # renormalised (norm_topk_prob False, as OLMoE's); the q and k norms over the whole
        # projections (64 and 2 KV heads x 16 = 32: of different lengths); the vocabulary
        # padded past the tokenizer's, as OLMoE's 50304 is past its 50280 (AutoTokenizer
        # reads an olmoe folder with GPTNeoXTokenizer, which adds <|padding|> after them);
        # OLMoE's eps, 1e-5, which llama.cpp's converter writes whatever the config says
        common["num_hidden_layers"], common["intermediate_size"] = 4, 64
        common["vocab_size"], common["rms_norm_eps"] = vocab_size + 64, 1e-5
        cfg = OlmoeConfig(
            **common, tie_word_embeddings=False, num_experts=8, num_experts_per_tok=3,
            norm_topk_prob=False, rope_parameters={"rope_type": "default", "rope_theta": 1e4},
        )  # fmt: skip
    else:
        raise ValueError(arch)
    for key, value in overrides.items():
        setattr(cfg, key, value)
    return cfg


def save_tiny_model(
    folder: Path, arch: str, seed: int = 0, chat_template: str = CHATML,
    tokenizer: str = "gpt2", **overrides,
) -> Path:  # fmt: skip
    """Random-weight HF model + tokenizer files in `folder` (`tokenizer`: one of
    TOKENIZER_STYLES); returns the folder."""
    from transformers import AutoModelForCausalLM

    folder.mkdir(parents=True, exist_ok=True)
    tok = train_tiny_tokenizer(style=tokenizer)
    tok.save(str(folder / "tokenizer.json"))
    eos = "<|return|>" if tokenizer == "harmony" else "</s>"  # as the harmony files name it
    tok_config = {"bos_token": "<s>", "eos_token": eos, "chat_template": chat_template}
    if tokenizer == "llama3":
        tok_config["add_bos_token"] = True
    (folder / "tokenizer_config.json").write_text(json.dumps(tok_config))
    torch.manual_seed(seed)
    cfg = tiny_config(arch, overrides.pop("vocab_size", tok.get_vocab_size()), **overrides)
    model = AutoModelForCausalLM.from_config(cfg, dtype=torch.float32)
    _bump_norm_and_biases(model, seed)
    model.save_pretrained(folder)
    return folder


def model_maker(tmp_path_factory, arch: str, models: dict, **common):
    """A fixture's factory: name in `models` ({name: (seed, overrides)}) -> the folder of
    that tiny `arch` model (save_tiny_model, `common` for every one), each made once."""
    made: dict[str, Path] = {}

    def make(name: str) -> Path:
        if name not in made:
            seed, overrides = models[name]
            made[name] = save_tiny_model(tmp_path_factory.mktemp(name), arch, seed=seed,
                                         **common, **overrides)  # fmt: skip
        return made[name]

    return make


def _bump_norm_and_biases(model, seed: int) -> None:
    """HF initialises norms to 1 and biases (a router's selection bias too) to 0; randomise
    them so a loader that drops or misplaces one fails the comparison."""
    g = torch.Generator().manual_seed(seed + 1)
    # gpt-oss's experts' biases (`gate_up_proj_bias`) and its attention sinks (a logit a
    # head, the softmax's extra column) too
    more = ("proj_bias", "sinks") if model.config.model_type == "gpt_oss" else ()
    # Gemma 4's norms around its experts (`post_feedforward_layernorm_1`, ...)
    norms = ("norm.weight", "norm_1.weight", "norm_2.weight")
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith(norms):
                p.copy_(1 + 0.1 * torch.randn(p.shape, generator=g))
            elif name.endswith("router.per_expert_scale"):  # Gemma 4's (HF: ones)
                p.copy_(1 + 0.2 * torch.randn(p.shape, generator=g))
            elif name.endswith("router.scale"):  # Gemma 4's router's input scale (HF:
                # ones): random, and its router sharpened as sharpen_routers does others'
                p.copy_(ROUTER_SCALE * (1 + 0.1 * torch.randn(p.shape, generator=g)))
            elif name.endswith((".bias", *more)):
                p.copy_(0.1 * torch.randn(p.shape, generator=g))
            if name.endswith("sinks"):
                p.copy_(torch.randn(p.shape, generator=g))
        for name, b in model.named_buffers():  # a router's selection bias (HF: zeros)
            if name.endswith(("expert_bias", "e_score_correction_bias")):
                b.copy_(0.05 * torch.randn(b.shape, generator=g))
            if name.endswith("layer_scalar"):  # a layer's output scale (HF: ones)
                b.copy_(1 + 0.2 * torch.randn(b.shape, generator=g))


def hf_logits(folder_or_model, ids: list[int], dtype: torch.dtype | None = None) -> torch.Tensor:
    """HF's teacher-forced logits (T, V); with `dtype`, the model loaded in it (fp64: the
    exact result both implementations are held to)."""
    from transformers import AutoModelForCausalLM

    model = folder_or_model
    if dtype is not None:  # a mixture's experts one at a time (no fp64 grouped product)
        model = AutoModelForCausalLM.from_pretrained(
            folder_or_model, dtype=dtype, experts_implementation="eager"
        ).eval()
    with torch.no_grad():
        return model(torch.tensor([ids])).logits[0]


# the tiny families' tests' prompt (test_lfm2, test_qwen35)
FRANCE = "What is the capital of France? The capital of France is"


def prompt_ids(llm, n: int = 40) -> list[int]:
    """The first n token ids of FRANCE repeated (the tiny families' teacher-forced ids)."""
    ids = llm.tokenizer.encode(FRANCE * 8)[:n]
    assert len(ids) == n
    return ids


def hf64(folder: Path):
    """transformers' model of `folder` in fp64 (a mixture's experts one at a time: its
    grouped product runs fp32 and bf16 only)."""
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float64,
                                                experts_implementation="eager").eval()  # fmt: skip


def assert_greedy_follows_hf(folder: Path, n: int = 32) -> None:
    """n greedy tokens after FRANCE: in fp64 transformers' fp64 tokens (`hf64`); by
    default (fp32) the top-5 rule against its fp32."""
    from kvlm import LLM, SamplingParams

    params = SamplingParams(temperature=0, max_tokens=n, ignore_eos=True, logprobs=5)
    fp64 = LLM(model=folder, kv="off", dtype="fp64", progress=False)
    ids = fp64.tokenizer.encode(FRANCE)
    out = fp64.generate(prompt_token_ids=[ids], sampling_params=params)[0]
    assert out.token_ids == hf_greedy(hf64(folder), ids, n)[0]
    llm = LLM(model=folder, progress=False)
    out = llm.generate(prompt_token_ids=[ids], sampling_params=params)[0]
    ref_ids, ref_logits = hf_greedy(load_hf(folder), ids, n)
    assert_greedy_agreement(out.token_ids, [list(lp.top) for lp in out.logprobs], ref_ids,
                            ref_logits)  # fmt: skip


def load_hf(folder: Path):
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32).eval()


def hf_greedy(model, prompt_ids: Sequence[int], n: int) -> tuple[list[int], torch.Tensor]:
    """HF generate, greedy, exactly n tokens (EOS disabled); returns ids and per-step logits.
    Every prompt token is attended to (a mask of ones: without one, transformers masks the
    tokens equal to the pad id, a BOS of id 0 too)."""
    ids = torch.tensor([list(prompt_ids)])
    out = model.generate(
        ids,
        attention_mask=torch.ones_like(ids),
        max_new_tokens=n,
        do_sample=False,
        eos_token_id=None,
        pad_token_id=0,
        return_dict_in_generate=True,
        output_logits=True,
    )
    ids = out.sequences[0, len(prompt_ids) :].tolist()
    return ids, torch.stack([lg[0].float() for lg in out.logits])


def hf_forced(
    model, prompt_ids: Sequence[int], tokens: Sequence[int]
) -> tuple[list[int], torch.Tensor]:
    """transformers' argmax and logits at each step of `tokens` (another engine's greedy
    answer to `prompt_ids`), from one forward over the prompt and tokens[:-1]: causal, so
    row i sees what decoding up to step i would. Up to the first step where `tokens` leave
    that argmax the prefixes are hf_greedy's, so these are its ids and logits there, and
    assert_greedy_agreement reads nothing past that step: one forward, not len(tokens)."""
    seq = torch.tensor([list(prompt_ids) + list(tokens[:-1])])
    with torch.no_grad():
        out = model(seq, attention_mask=torch.ones_like(seq))  # every token attended (hf_greedy)
    logits = out.logits[0, len(prompt_ids) - 1 :].float()
    return logits.argmax(-1).tolist(), logits


def assert_greedy_agreement(
    ours: Sequence[int],
    our_top: Sequence[Sequence[int]],
    ref: Sequence[int],
    ref_logits: torch.Tensor,
    k: int = 5,
) -> int | None:
    """Tokens identical until the first divergence; there, each side's token must be in
    the other side's top-k. Returns the divergence index (None when all equal)."""
    assert len(ours) == len(ref), (len(ours), len(ref))
    for i, (a, b) in enumerate(zip(ours, ref, strict=True)):
        if a != b:
            ref_top = torch.topk(ref_logits[i], k).indices.tolist()
            assert a in ref_top, f"step {i}: ours {a} not in reference top-{k} {ref_top}"
            assert b in list(our_top[i])[:k], f"step {i}: ref {b} not in our top-{k} {our_top[i]}"
            return i
    return None


def forward_in_chunks(llm, ids: list[int], mode: str, chunk: int) -> torch.Tensor:
    """The last logits of `ids` fed to a fresh cache of `mode` `chunk` tokens a forward."""
    cache = llm.new_cache(mode)
    for start in range(0, len(ids), chunk):
        logits = llm.runner.forward(ids[start : start + chunk], cache)
    assert cache.num_tokens == len(ids)
    return logits


def assert_same_greedy(llm, ids: list[int], mode: str, params, chunk: int) -> None:
    """Greedy tokens of a chunked prefill (`params` with logprobs) held to the one-shot
    run's by the top-5 rule, each a request through the engine's one loop on a fresh cache
    of `mode`."""
    from kvlm.engine.batch import Stream

    def run(prefill_chunk):
        engine = llm.cache_engine(llm.new_cache(mode), prefill_chunk=prefill_chunk)
        return Stream(engine, ids, params).run()

    whole, chunked = run(None), run(chunk)
    assert len(chunked.token_ids) == len(whole.token_ids) == params.max_tokens
    if chunked.token_ids == whole.token_ids:
        return  # the rule reads the reference's logits only at a divergence
    ref_logits = llm.runner.logits(ids + whole.token_ids[:-1], llm.new_cache("off"))
    ref_logits = ref_logits[len(ids) - 1 :]
    our_top = [list(lp.top) for lp in chunked.logprobs]
    assert_greedy_agreement(chunked.token_ids, our_top, whole.token_ids, ref_logits)


# ---------------------------------------------------------------------------- GGUF writing


def permute_qk(w: np.ndarray, n_heads: int) -> np.ndarray:
    """llama.cpp's convert_hf_to_gguf permutation (the inverse of what kvlm undoes)."""
    return (
        w.reshape(n_heads, 2, w.shape[0] // n_heads // 2, *w.shape[1:])
        .swapaxes(1, 2)
        .reshape(w.shape)
    )


_GGUF_NAMES = {
    "input_layernorm": "attn_norm",
    "post_attention_layernorm": "ffn_norm",
    "self_attn.q_proj": "attn_q",
    "self_attn.k_proj": "attn_k",
    "self_attn.v_proj": "attn_v",
    "self_attn.o_proj": "attn_output",
    "self_attn.q_norm": "attn_q_norm",
    "self_attn.k_norm": "attn_k_norm",
    "mlp.gate_proj": "ffn_gate",
    "mlp.up_proj": "ffn_up",
    "mlp.down_proj": "ffn_down",
}


def gguf_name(hf: str, names: dict[str, str] = _GGUF_NAMES) -> str:
    if hf == "model.embed_tokens.weight":
        return "token_embd.weight"
    if hf == "model.norm.weight":
        return "output_norm.weight"
    if hf == "lm_head.weight":
        return "output.weight"
    parts = hf.split(".")  # model.layers.N.<module...>.weight
    module = ".".join(parts[3:-1])
    return f"blk.{parts[2]}.{names[module]}.{parts[-1]}"


# Gemma's names where they differ from Llama's (llama.cpp's tensor mapping)
_GEMMA_GGUF_NAMES = {
    **_GGUF_NAMES,
    "pre_feedforward_layernorm": "ffn_norm",
    "post_attention_layernorm": "post_attention_norm",
    "post_feedforward_layernorm": "post_ffw_norm",
}

SP_CORPUS = [
    "The quick brown fox jumps over the lazy dog. The dog sleeps in the sun.",
    "def add(a, b):\n    return a + b\n\n\nprint(add(1, 2))",
    "東京は日本の首都です。京都は古い都です。",
    "Привет, мир! Как дела? Мир большой.",
    "    indented    text\twith\ttabs   and   runs of  spaces",
] * 4


def sentencepiece_vocab() -> tuple[list[str], list[int], list[float]]:
    """A Gemma-like SentencePiece vocabulary as a GGUF stores it: (tokens, types, scores).
    Control tokens first, 256 byte tokens, user-defined chat markers, runs of spaces spelled
    in spaces, then BPE pieces (spaces as "▁") learned on SP_CORPUS in merge order. The
    stored scores do not follow that order (they are shuffled), as in Gemma's files."""
    from tokenizers import Tokenizer, models, normalizers, trainers

    tok = Tokenizer(models.BPE())
    tok.normalizer = normalizers.Replace(" ", "▁")
    trainer = trainers.BpeTrainer(vocab_size=400, show_progress=False)
    tok.train_from_iterator(SP_CORPUS, trainer)
    learned = [t for t, _ in sorted(tok.get_vocab().items(), key=lambda kv: kv[1])]
    control = ["<pad>", "<eos>", "<bos>", "<unk>"]
    spaces = [" " * n for n in range(2, 6)]
    user = ["<start_of_turn>", "<end_of_turn>"]
    tokens = [*control, *(f"<0x{b:02X}>" for b in range(256)), *user, *spaces]
    tokens += [t for t in learned if t not in tokens and "▁▁" not in t]
    types = [3] * 4 + [6] * 256 + [4] * 2 + [1] * (len(tokens) - 262)
    scores = np.random.default_rng(0).permutation(len(tokens)).astype(float).tolist()
    return tokens, types, scores


GEMMA_TEMPLATE = (
    "{{ bos_token }}{% for m in messages %}<start_of_turn>"
    "{{ 'model' if m['role'] == 'assistant' else m['role'] }}\n{{ m['content'] }}"
    "<end_of_turn>\n{% endfor %}{% if add_generation_prompt %}<start_of_turn>model\n{% endif %}"
)


def _add_sentencepiece(w) -> None:
    tokens, types, scores = sentencepiece_vocab()
    w.add_tokenizer_model("llama")
    w.add_tokenizer_pre("default")
    w.add_token_list(tokens)
    w.add_token_types(types)
    w.add_token_scores(scores)
    w.add_bos_token_id(2)
    w.add_eos_token_id(1)
    w.add_unk_token_id(3)
    w.add_pad_token_id(0)
    w.add_add_bos_token(True)
    w.add_add_space_prefix(False)
    w.add_chat_template(GEMMA_TEMPLATE)


def write_gguf_from_hf(
    folder: Path,
    out: Path,
    quant=None,
    arch: str = "llama",
    extra_tensors: dict[str, tuple[np.ndarray, object]] | None = None,
    types: dict[str, object] | None = None,
    metadata: dict[str, tuple[object, object]] | None = None,
) -> Path:
    """Write an HF tiny model as a GGUF the way llama.cpp's converter would.

    `metadata`: more keys, each (value, its GGUFValueType), as the converter adds them
    (`general.sampling.*` from a generation_config.json).

    `quant` (a GGMLQuantizationType) applies to 2-D weights whose rows fit its block size;
    norms stay F32, as llama.cpp keeps them. `types`: GGUF name patterns (fnmatch, first
    match wins) -> the type of those tensors instead (a Q4_K_M-like mix: {"*attn_v*":
    Q6_K, "*": Q4_K}); the K-quants are written by `quantize_blocks`.
    """
    from fnmatch import fnmatch

    import gguf
    from safetensors.torch import load_file
    from tokenizers import Tokenizer

    from kvlm.bench.models import Shape, add_shape

    cfg = json.loads((folder / "config.json").read_text())
    tensors = {}
    for f in sorted(folder.glob("*.safetensors")):
        tensors.update(load_file(str(f)))
    heads, kv_heads = cfg["num_attention_heads"], cfg["num_key_value_heads"]
    head_dim = cfg.get("head_dim") or cfg["hidden_size"] // heads

    w = gguf.GGUFWriter(str(out), arch)
    rope = cfg.get("rope_parameters") or {}
    theta = float(cfg.get("rope_theta") or rope.get("full_attention", rope)["rope_theta"])
    tied = cfg.get("tie_word_embeddings", False)
    shape = Shape(arch, cfg["hidden_size"], cfg["num_hidden_layers"], heads, kv_heads, head_dim,
                  cfg["intermediate_size"], cfg["vocab_size"], tied, theta,
                  cfg["max_position_embeddings"], cfg["rms_norm_eps"])  # fmt: skip
    add_shape(w, shape)
    if rope.get("rope_type") in ("linear", "yarn"):  # as llama.cpp's converter writes it
        w.add_rope_scaling_type(gguf.RopeScalingType(rope["rope_type"]))
        w.add_rope_scaling_factor(rope["factor"])
        if rope["rope_type"] == "yarn":
            w.add_rope_scaling_orig_ctx_len(rope["original_max_position_embeddings"])
    if arch in ("gemma2", "gemma3"):  # the window, a SentencePiece vocabulary of Gemma's
        w.add_sliding_window(cfg["sliding_window"])
        _add_sentencepiece(w)
        for cap, add in (("attn", w.add_attn_logit_softcapping),
                         ("final", w.add_final_logit_softcapping)):  # fmt: skip
            if cfg.get(f"{cap}_logit_softcapping") is not None:
                add(cfg[f"{cap}_logit_softcapping"])
    else:
        _add_tokenizer(w, Tokenizer.from_file(str(folder / "tokenizer.json")))
    for key, (value, vtype) in (metadata or {}).items():
        w.add_key_value(key, value, vtype)
    replace = dict(extra_tensors or {})  # GGUF name -> (array or packed bytes, type)
    for name, t in tensors.items():
        arr = t.float().numpy()
        if arch == "llama" and name.endswith("q_proj.weight"):
            arr = permute_qk(arr, heads)
        elif arch == "llama" and name.endswith("k_proj.weight"):
            arr = permute_qk(arr, kv_heads)
        gemma = arch in ("gemma2", "gemma3")
        if gemma and name.endswith("norm.weight"):
            arr = arr + 1  # llama.cpp's converter stores Gemma's norms as 1 + w
        gname = gguf_name(name, _GEMMA_GGUF_NAMES if gemma else _GGUF_NAMES)
        if gname in replace:
            continue
        qtype = next((t for p, t in (types or {}).items() if fnmatch(gname, p)), quant)
        _add_tensor(w, gname, arr, qtype)
    for name, (arr, qtype) in replace.items():
        _add_tensor(w, name, arr, qtype)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return out


def _add_tensor(w, name: str, arr: np.ndarray, quant) -> None:
    import gguf
    from gguf import GGMLQuantizationType as Q

    if arr.dtype == np.uint8:  # pre-packed raw blocks (rows, bytes)
        w.add_tensor(name, arr, raw_shape=arr.shape, raw_dtype=quant)
        return
    block = gguf.GGML_QUANT_SIZES[quant][0] if quant is not None else 1
    if quant is None or quant == Q.F32 or arr.ndim != 2 or arr.shape[1] % block:
        w.add_tensor(name, arr.astype(np.float32))
        return
    if quant in (Q.Q4_K, Q.Q5_K, Q.Q6_K):
        data = quantize_blocks(arr.astype(np.float32), quant.name)
    else:
        data = gguf.quants.quantize(arr.astype(np.float32), quant)
    w.add_tensor(name, data, raw_shape=data.shape, raw_dtype=quant)


def _add_tokenizer(w, tok) -> None:
    data = json.loads(tok.to_str())
    vocab = data["model"]["vocab"]
    tokens = [t for t, _ in sorted(vocab.items(), key=lambda kv: kv[1])]
    merges = [m if isinstance(m, str) else " ".join(m) for m in data["model"]["merges"]]
    specials = {a["content"] for a in data["added_tokens"] if a["special"]}
    w.add_tokenizer_model("gpt2")
    w.add_tokenizer_pre("gpt2")
    w.add_token_list(tokens)
    w.add_token_types([3 if t in specials else 1 for t in tokens])
    w.add_token_merges(merges)
    w.add_bos_token_id(vocab["<s>"])
    w.add_eos_token_id(vocab["</s>"])
    w.add_add_bos_token(False)
    w.add_chat_template(CHATML)


# ------------------------------------------- reference block decoders (ggml's C layouts)


def _f16(b: np.ndarray) -> np.ndarray:
    return b.copy().view(np.float16).astype(np.float32)


def ref_dequant_rows(
    raw: np.ndarray, qtype_name: str, with_size: bool = False
) -> np.ndarray | tuple[np.ndarray, np.ndarray]:
    """Decode (rows, bytes) blocks written in ggml's layout, independently of gguf-py, as
    fp32. `with_size`: in fp64 (exact: products of fp16 parameters and small integers), with
    each value's size |scaled code| + |offset|, the magnitude its fp32 rounding scales with."""
    if not with_size:
        return np.stack([_ref_row(row, qtype_name) for row in raw])
    rows = [_ref_row(row, qtype_name, exact=True) for row in raw]
    return np.stack([r[0] for r in rows]), np.stack([r[1] for r in rows])


def _ref_row(row: np.ndarray, kind: str, exact: bool = False):
    """One row decoded as scaled codes plus an offset, each term exact in fp64 (fp16
    parameters times small integers). The fp32 value is that sum rounded once, which is also
    what the fp32 arithmetic of these formulas gives (every partial product fits 24 bits
    but Q6_K's, whose one rounding is the same). `exact`: (fp64 values, |term| + |offset|)."""
    size = {"Q8_0": 34, "Q4_0": 18, "Q4_1": 20, "Q5_0": 22, "Q5_1": 24, "Q4_K": 144,
            "Q5_K": 176, "Q6_K": 210}[kind]  # fmt: skip
    terms = [_ref_terms(blk, kind) for blk in row.reshape(-1, size)]
    a = np.concatenate([t[0] for t in terms])
    b = np.concatenate([t[1] for t in terms])
    if exact:
        return a + b, np.abs(a) + np.abs(b)
    return (a + b).astype(np.float32)


def _ref_terms(blk: np.ndarray, kind: str) -> tuple[np.ndarray, np.ndarray]:
    """A block's (scaled codes, offset), fp64."""
    f16 = lambda b: _f16(b).astype(np.float64)  # noqa: E731
    if kind == "Q8_0":  # d, qs[32] int8
        return f16(blk[0:2]) * blk[2:].view(np.int8), np.zeros(32)
    if kind == "Q4_0":  # d, qs[16]: low nibbles are 0..15, high nibbles 16..31
        d, qs = f16(blk[0:2]), blk[2:].astype(np.int32)
        return d * (np.concatenate([qs & 15, qs >> 4]) - 8), np.zeros(32)
    if kind == "Q4_1":  # d, m, qs[16]
        d, m, qs = f16(blk[0:2]), f16(blk[2:4]), blk[4:].astype(np.int32)
        return d * np.concatenate([qs & 15, qs >> 4]), np.repeat(m, 32)
    if kind in ("Q5_0", "Q5_1"):  # d, (m), qh: bit e of a little-endian uint32, qs[16]
        at = 2 if kind == "Q5_0" else 4
        d, qh = f16(blk[0:2]), int.from_bytes(blk[at : at + 4].tobytes(), "little")
        qs = blk[at + 4 :].astype(np.int32)
        codes = np.concatenate([qs & 15, qs >> 4]) + 16 * np.array(
            [(qh >> e) & 1 for e in range(32)]
        )
        if kind == "Q5_0":
            return d * (codes - 16), np.zeros(32)
        return d * codes, np.repeat(f16(blk[2:4]), 32)
    if kind in ("Q4_K", "Q5_K"):  # d, dmin, scales[12], (qh[32]: bit s = sub-block s), qs[128]
        d, dmin = f16(blk[0:2]), f16(blk[2:4])
        sc, mn = _unpack_k4_scales(blk[4:16].astype(np.int32))
        qs = blk[-128:].astype(np.int32).reshape(4, 32)
        codes = np.concatenate([np.concatenate([q & 15, q >> 4]) for q in qs])
        if kind == "Q5_K":
            qh = blk[16:48].astype(np.int32)
            codes = codes + 16 * np.concatenate([(qh >> s) & 1 for s in range(8)])
        return d * sc.repeat(32) * codes, -dmin * mn.repeat(32)
    # Q6_K: ql[128], qh[64], scales[16] int8, d
    ql, qh = blk[:128].astype(np.int32), blk[128:192].astype(np.int32)
    scales = blk[192:208].view(np.int8).astype(np.float64)
    d = f16(blk[208:210])
    codes = np.empty(256, np.int32)
    for n in range(2):
        lo, hi = ql[64 * n : 64 * n + 64], qh[32 * n : 32 * n + 32]
        for g, (nib, shift) in enumerate(
            [(lo[:32] & 15, 0), (lo[32:] & 15, 2), (lo[:32] >> 4, 4), (lo[32:] >> 4, 6)]
        ):
            codes[128 * n + 32 * g : 128 * n + 32 * g + 32] = nib | (((hi >> shift) & 3) << 4)
    return d * scales.repeat(16) * (codes - 32), np.zeros(256)


def _unpack_k4_scales(s: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    sc = np.array(
        [s[j] & 63 if j < 4 else (s[j + 4] & 15) | ((s[j - 4] >> 6) << 4) for j in range(8)]
    )
    mn = np.array(
        [s[j + 4] & 63 if j < 4 else (s[j + 4] >> 4) | ((s[j] >> 6) << 4) for j in range(8)]
    )
    return sc.astype(np.float32), mn.astype(np.float32)


# ggml's block layouts (ggml-common.h) written from codes and parameters, over many blocks
# at once: d, dmin, m (B,) fp16 values; codes (B, weights) in element order.


def _f16_bytes(x) -> np.ndarray:
    return np.asarray(x, np.float16).reshape(-1, 1).view(np.uint8)


def _k4_scale_bytes(sc: np.ndarray, mn: np.ndarray) -> np.ndarray:
    """8 sub-blocks' 6-bit scales and mins (B, 8) -> ggml's 12 packed bytes (B, 12)."""
    s = np.zeros((sc.shape[0], 12), np.int64)
    s[:, 0:4] = (sc[:, :4] & 63) | ((sc[:, 4:] >> 4) << 6)
    s[:, 4:8] = (mn[:, :4] & 63) | ((mn[:, 4:] >> 4) << 6)
    s[:, 8:12] = (sc[:, 4:] & 15) | ((mn[:, 4:] & 15) << 4)
    return s.astype(np.uint8)


def _k_nibbles(codes: np.ndarray) -> np.ndarray:
    """(B, 256) -> qs (B, 128): bytes 32j .. 32j + 31 hold sub-block 2j (low nibbles) and
    2j + 1 (high)."""
    c = codes.reshape(-1, 4, 2, 32)
    return ((c[:, :, 0] & 15) | ((c[:, :, 1] & 15) << 4)).reshape(-1, 128).astype(np.uint8)


def ggml_q4_k(d, dmin, sc, mn, codes) -> np.ndarray:
    parts = [_f16_bytes(d), _f16_bytes(dmin), _k4_scale_bytes(sc, mn), _k_nibbles(codes)]
    return np.concatenate(parts, 1)


def ggml_q5_k(d, dmin, sc, mn, codes) -> np.ndarray:
    qh = ((codes.reshape(-1, 8, 32) >> 4) << np.arange(8)[:, None]).sum(1)  # bit s: sub-block s
    parts = [_f16_bytes(d), _f16_bytes(dmin), _k4_scale_bytes(sc, mn), qh.astype(np.uint8)]
    return np.concatenate([*parts, _k_nibbles(codes)], 1)


def ggml_q6_k(d, sc, codes) -> np.ndarray:
    """sc (B, 16) int8 per 16 weights; codes (B, 256) 0..63 (the weight is d sc (q - 32))."""
    c = codes.reshape(-1, 2, 4, 32)  # per half of 128: four rows of 32
    ql = np.stack(
        [
            (c[:, :, 0] & 15) | ((c[:, :, 2] & 15) << 4),
            (c[:, :, 1] & 15) | ((c[:, :, 3] & 15) << 4),
        ],
        2,
    )
    qh = ((c >> 4) << (2 * np.arange(4))[:, None]).sum(2)
    parts = [ql.reshape(-1, 128), qh.reshape(-1, 64), np.asarray(sc, np.int8).view(np.uint8)]
    return np.concatenate([p.astype(np.uint8) for p in parts] + [_f16_bytes(d)], 1)


def _q5_bits(codes: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """(B, 32) 5-bit codes -> qh (B, 4: bit e of a little-endian uint32 = weight e's fifth
    bit), qs (B, 16: weight j low nibble, j + 16 high)."""
    qs = (codes[:, :16] & 15) | ((codes[:, 16:] & 15) << 4)
    qh = ((codes >> 4) << np.arange(32)).sum(1).astype("<u4").view(np.uint8).reshape(-1, 4)
    return qh, qs.astype(np.uint8)


def ggml_q4_0(d, codes) -> np.ndarray:
    """codes (B, 32) 0..15 (the weight is d (q - 8)): qs[j] = weight j low, j + 16 high."""
    qs = (codes[:, :16] & 15) | ((codes[:, 16:] & 15) << 4)
    return np.concatenate([_f16_bytes(d), qs.astype(np.uint8)], 1)


def ggml_q5_0(d, codes) -> np.ndarray:
    return np.concatenate([_f16_bytes(d), *_q5_bits(codes)], 1)


def ggml_q5_1(d, m, codes) -> np.ndarray:
    return np.concatenate([_f16_bytes(d), _f16_bytes(m), *_q5_bits(codes)], 1)


def pack_q6_k(rows: int, cols: int, rng: np.random.Generator) -> np.ndarray:
    """Random Q6_K blocks (rows, cols/256*210) from random 6-bit codes and scales."""
    nb = rows * cols // 256
    codes, sc = rng.integers(0, 64, (nb, 256)), rng.integers(-60, 60, (nb, 16))
    return ggml_q6_k(rng.uniform(0.001, 0.01, nb), sc, codes).reshape(rows, -1)


def pack_q4_k(rows: int, cols: int, rng: np.random.Generator) -> np.ndarray:
    """Random Q4_K blocks (rows, cols/256*144): 4-bit codes, 6-bit scales and mins."""
    nb = rows * cols // 256
    codes, sc, mn = rng.integers(0, 16, (nb, 256)), *rng.integers(0, 64, (2, nb, 8))
    d, dmin = rng.uniform(0.001, 0.01, (2, nb))
    return ggml_q4_k(d, dmin, sc, mn, codes).reshape(rows, -1)


def pack_q5_k(rows: int, cols: int, rng: np.random.Generator) -> np.ndarray:
    """Random Q5_K blocks (rows, cols/256*176): 5-bit codes, 6-bit scales and mins."""
    nb = rows * cols // 256
    codes, sc, mn = rng.integers(0, 32, (nb, 256)), *rng.integers(0, 64, (2, nb, 8))
    d, dmin = rng.uniform(0.001, 0.01, (2, nb))
    return ggml_q5_k(d, dmin, sc, mn, codes).reshape(rows, -1)


def pack_q4_0(rows: int, cols: int, rng: np.random.Generator) -> np.ndarray:
    """Random Q4_0 blocks (rows, cols/32*18): 4-bit codes, one scale of either sign."""
    nb = rows * cols // 32
    return ggml_q4_0(rng.uniform(-0.05, 0.05, nb), rng.integers(0, 16, (nb, 32))).reshape(rows, -1)


def pack_q5_0(rows: int, cols: int, rng: np.random.Generator) -> np.ndarray:
    """Random Q5_0 blocks (rows, cols/32*22): 5-bit codes, one scale of either sign."""
    nb = rows * cols // 32
    return ggml_q5_0(rng.uniform(-0.05, 0.05, nb), rng.integers(0, 32, (nb, 32))).reshape(rows, -1)


def pack_q5_1(rows: int, cols: int, rng: np.random.Generator) -> np.ndarray:
    """Random Q5_1 blocks (rows, cols/32*24): 5-bit codes, a scale and a minimum."""
    nb = rows * cols // 32
    d, m = rng.uniform(0.001, 0.05, nb), rng.uniform(-0.5, 0.0, nb)
    return ggml_q5_1(d, m, rng.integers(0, 32, (nb, 32))).reshape(rows, -1)


PACKERS = {"Q4_K": pack_q4_k, "Q5_K": pack_q5_k, "Q6_K": pack_q6_k, "Q4_0": pack_q4_0,
           "Q5_0": pack_q5_0, "Q5_1": pack_q5_1}  # fmt: skip
# byte offsets of each block's fp16 fields (d, dmin, m)
_F16_FIELDS = {"Q4_K": (0, 2), "Q5_K": (0, 2), "Q6_K": (208,), "Q5_0": (0,), "Q5_1": (0, 2),
               "Q4_0": (0,), "Q4_1": (0, 2), "Q8_0": (0,), "Q3_K": (108,),
               "Q2_K": (80, 82), "MXFP4": ()}  # fmt: skip


def random_blocks(qtype_name: str, rows: int, cols: int, rng: np.random.Generator) -> np.ndarray:
    """Blocks of random bytes (every code, scale byte and high bit pattern, int8 scales
    down to -128), their fp16 fields finite, of either sign, some subnormal or zero;
    MXFP4's exponent bytes 110 .. 135 (scales 2^-18 .. 2^7: values of a model's weights,
    none overflowing fp32)."""
    import gguf

    per, size = gguf.GGML_QUANT_SIZES[gguf.GGMLQuantizationType[qtype_name]]
    b = rng.integers(0, 256, (rows, cols // per, size), dtype=np.uint8)
    for at in _F16_FIELDS[qtype_name]:
        d = rng.uniform(-0.02, 0.02, (rows, cols // per)) * (rng.random((rows, cols // per)) < 0.95)
        d[..., :1] *= 2.0**-12  # fp16 subnormals
        b[..., at : at + 2] = d.astype(np.float16)[..., None].view(np.uint8)
    if qtype_name == "MXFP4":
        b[..., 0] = rng.integers(110, 136, (rows, cols // per), dtype=np.uint8)
    return b.reshape(rows, -1)


def quantize_blocks(arr: np.ndarray, qtype_name: str) -> np.ndarray:
    """A float weight (rows, cols) as valid ggml blocks of a type gguf-py cannot quantize
    (the K-quants): near min/max rounding, not llama.cpp's search, but the file's layout
    and numerics exactly."""
    rows = arr.shape[0]
    if qtype_name in ("Q4_K", "Q5_K"):
        top = 15 if qtype_name == "Q4_K" else 31
        x = arr.reshape(-1, 8, 32).astype(np.float64)
        lo, hi = np.minimum(x.min(-1), 0.0), np.maximum(x.max(-1), 0.0)
        d = (((hi - lo) / top).max(-1) / 63).astype(np.float16)
        dmin = ((-lo).max(-1) / 63).astype(np.float16)
        dd, dm = d.astype(np.float64)[:, None], dmin.astype(np.float64)[:, None]
        with np.errstate(divide="ignore", invalid="ignore"):
            sc = np.nan_to_num(np.rint((hi - lo) / top / dd)).clip(0, 63).astype(np.int64)
            mn = np.nan_to_num(np.rint(-lo / dm)).clip(0, 63).astype(np.int64)
            step, low = (dd * sc)[..., None], (dm * mn)[..., None]
            codes = np.nan_to_num(np.rint((x + low) / step)).clip(0, top).astype(np.int64)
        write = ggml_q4_k if qtype_name == "Q4_K" else ggml_q5_k
        return write(d, dmin, sc, mn, codes.reshape(-1, 256)).reshape(rows, -1)
    if qtype_name == "Q6_K":
        x = arr.reshape(-1, 16, 16).astype(np.float64)
        scale = np.abs(x).max(-1) / 31
        d = (scale.max(-1) / 127).astype(np.float16)
        dd = d.astype(np.float64)[:, None]
        with np.errstate(divide="ignore", invalid="ignore"):
            sc = np.nan_to_num(np.rint(scale / dd)).clip(-128, 127).astype(np.int64)
            codes = np.nan_to_num(np.rint(x / (dd * sc)[..., None])) + 32
        return ggml_q6_k(d, sc, codes.clip(0, 63).astype(np.int64).reshape(-1, 256)).reshape(
            rows, -1
        )
    raise ValueError(qtype_name)


def write_spm_gguf(path: Path) -> Path:
    """A metadata-only GGUF with a SentencePiece-style vocabulary (`tokenizer.ggml.model`
    = llama): byte tokens <0x00>.., pieces with '▁', scores ranking the merges."""
    import gguf
    from tokenizers import SentencePieceBPETokenizer

    sp = SentencePieceBPETokenizer()
    sp.train_from_iterator(
        CORPUS, vocab_size=400, special_tokens=["<unk>", "<s>", "</s>"], show_progress=False
    )
    data = json.loads(sp.to_str())
    merges = [m if isinstance(m, str) else " ".join(m) for m in data["model"]["merges"]]
    rank = {m.replace(" ", ""): i for i, m in enumerate(merges)}
    tokens = ["<unk>", "<s>", "</s>"] + [f"<0x{b:02X}>" for b in range(256)]
    types = [2, 3, 3] + [6] * 256
    scores = [0.0] * len(tokens)
    for piece, _ in sorted(data["model"]["vocab"].items(), key=lambda kv: kv[1]):
        if piece not in tokens:
            tokens.append(piece)
            types.append(1)
            scores.append(-float(rank[piece] + 1) if piece in rank else 0.0)
    w = gguf.GGUFWriter(str(path), "llama")
    w.add_block_count(1)
    w.add_context_length(64)
    w.add_embedding_length(8)
    w.add_feed_forward_length(16)
    w.add_head_count(2)
    w.add_head_count_kv(1)
    w.add_layer_norm_rms_eps(1e-6)
    w.add_tokenizer_model("llama")
    w.add_token_list(tokens)
    w.add_token_scores(scores)
    w.add_token_types(types)
    w.add_bos_token_id(1)
    w.add_eos_token_id(2)
    w.add_unk_token_id(0)
    w.add_add_bos_token(True)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return path


def reference_generation(ref, prompt: str, n: int) -> tuple[list[int], torch.Tensor]:
    """`ref`'s (an fp32 LLM) greedy n tokens on `prompt` and its teacher-forced logits at
    each (the `off` oracle): what assert_generation_agrees holds another LLM to."""
    from kvlm import SamplingParams

    params = SamplingParams(temperature=0, max_tokens=n, ignore_eos=True)
    a = ref.generate(prompt, params)[0]
    ids = ref.tokenizer.encode(prompt) + a.token_ids[:-1]
    return a.token_ids, ref.runner.logits(ids, ref.new_cache("off"))[-n:]


def assert_generation_agrees(ref, llm, prompt: str, n: int, reference=None) -> None:
    """Greedy n tokens from `ref` (an fp32 LLM) and `llm` on `prompt`; `llm`'s tokens held to
    the top-5 rule against `ref`'s teacher-forced logits (the `off` oracle). `reference`:
    reference_generation(ref, prompt, n), made once where several LLMs are held to it."""
    from kvlm import SamplingParams

    ref_ids, ref_logits = reference or reference_generation(ref, prompt, n)
    params = SamplingParams(temperature=0, max_tokens=n, ignore_eos=True, logprobs=5)
    b = llm.generate(prompt, params)[0]
    our_top = [list(lp.top) for lp in b.logprobs]
    assert_greedy_agreement(b.token_ids, our_top, ref_ids, ref_logits)


# The builds a CPU without AVX-512 runs: "x86-64", the scalar loops (no AVX2 either); and
# "haswell", AVX2 + FMA + F16C, where qgemm.c's vector code runs as two halves (v512.h).
PORTABLE_BUILDS = ("x86-64", "haswell")


def _portable_library(march: str) -> str:
    """qgemm.c built for `march`, once per test session (a build takes 6-13 s)."""
    import atexit
    import shutil
    import tempfile

    import pytest

    from kvlm import kernels

    if march not in _BUILT:
        folder = tempfile.mkdtemp(prefix=f"kvlm-kernels-{march}-")
        atexit.register(shutil.rmtree, folder, ignore_errors=True)
        # -O2, not the product's -O3: the same arithmetic (no -ffast-math, and -std=c11
        # keeps -ffp-contract=off, so neither level reorders or fuses a float operation),
        # built in a third of the time (the AVX2 halves: ~13 s against ~35 s on a Zen 3)
        opt = {"-O3": "-O2", "-march=native": f"-march={march}"}
        flags = tuple(opt.get(f, f) for f in kernels.FLAGS)
        with pytest.MonkeyPatch.context() as mp:
            mp.setenv("KVLM_CACHE_DIR", folder)
            _BUILT[march] = str(kernels._build(kernels._compiler(), flags))
    return _BUILT[march]


_BUILT: dict[str, str] = {}


def portable_kernels(march: str = "x86-64"):
    """qgemm.c built for another CPU than this one: "x86-64" (no AVX-512, no AVX2: the
    scalar loops) or "haswell" (AVX2: the vector code in halves). On a CPU whose own build
    is already the AVX2 one, "haswell" is that build."""
    import ctypes

    from kvlm import kernels

    native = kernels.library()
    if march == "haswell" and native is not None and native.kvlm_kernel_simd() == 256:
        return native
    return kernels._bind(ctypes.CDLL(_portable_library(march)))


def portable_build_params():
    """pytest params over PORTABLE_BUILDS, each skipped where it is this CPU's own build or
    cannot run here (the AVX2 build on a CPU without AVX2, FMA and F16C)."""
    import pytest

    from kvlm import kernels

    lib = kernels.library()
    simd = lib.kvlm_kernel_simd() if lib is not None else None
    flags = set(kernels.cpu_flags())
    out = []
    for march in PORTABLE_BUILDS:
        why = ""
        if simd is None:
            why = kernels.status()
        elif march == "x86-64" and simd == 0:
            why = "this CPU's own build is the scalar one"
        elif march == "haswell" and simd == 256:
            why = "this CPU's own build is the AVX2 one"
        elif march == "haswell" and not {"avx2", "fma", "f16c"} <= flags:
            why = "no AVX2 + FMA + F16C on this CPU"
        out.append(pytest.param(march, id=march, marks=pytest.mark.skipif(bool(why), reason=why)))
    return out


def portable_simd(march: str) -> int:
    """What kvlm_kernel_simd() answers for a portable build"""
    return {"x86-64": 0, "haswell": 256}[march]


# ------------------------------------------------------------------ kernels and fused step


def _kernel_marks():
    import pytest

    from kvlm import kernels

    lib = kernels.library()
    kernels_ = pytest.mark.skipif(lib is None, reason=kernels.status())
    vector = pytest.mark.skipif(
        lib is None or lib.kvlm_kernel_simd() == 0,
        reason="the kernels' vector code (AVX-512, or AVX2 in halves) is not built here",
    )
    return kernels_, vector


needs_kernels, needs_vector_kernels = _kernel_marks()


def low_bit_llm(**settings):
    """An LLM with low-bit weights (native unless named) multiplied on fp32 activations
    and fp32 prompt products over an fp32 cache: the exact products, whatever the defaults
    pick."""
    from kvlm import LLM

    named = {"progress": False, "weights": "native", "activations": "fp32",
             "prefill_dtype": "fp32", "kv_dtype": "fp32"}  # fmt: skip
    return LLM(**{**named, **settings})


def fused_and_torch(llm, prompt: Sequence[int], steps: int, mode: str = "contiguous"):
    """The fused step's greedy tokens after `prompt`, fed to the fused step and to the torch
    model, each over a cache of its own: tokens, both logits (steps, V), both caches."""
    runner = llm.runner
    fused_cache, torch_cache = llm.new_cache(mode), llm.new_cache(mode)
    token = int(runner.forward(prompt, fused_cache).argmax())
    runner.forward(prompt, torch_cache)
    assert runner.fused_for(fused_cache) is not None, runner.fused_reason
    tokens, fused, ref, reason = [], [], [], runner.fused_reason
    for _ in range(steps):
        tokens.append(token)
        fused.append(runner.forward([token], fused_cache))
        runner.fused_reason = "off for the comparison"
        try:
            ref.append(runner.forward([token], torch_cache))
        finally:
            runner.fused_reason = reason
        token = int(fused[-1].argmax())
    assert fused_cache.num_tokens == torch_cache.num_tokens
    return tokens, torch.stack(fused), torch.stack(ref), fused_cache, torch_cache


def fused_steps_on(llm, lib, prompt: Sequence[int], steps: Sequence[int]):
    """`prompt` prefilled on a contiguous cache, then `steps` through the fused step with
    the kernels `lib` (a portable build's, or the native one): the logits (steps, V) and
    the cache."""
    import pytest

    from kvlm import kernels
    from kvlm.model.fused import FusedDecoder

    cache = llm.new_cache("contiguous")
    llm.runner.forward(prompt, cache)
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(kernels, "library", lambda: lib)
        slots = cache.spec.max_tokens
        mp.setitem(llm.runner._fused, slots, FusedDecoder(llm.model, slots))
        logits = torch.stack([llm.runner.forward([t], cache) for t in steps])
    return logits, cache


def assert_forked_rows_alone(llm, prompt: Sequence[int], more: Sequence[int]) -> None:
    """A prompt's cache forked into 3 rows fed different tokens of `more` (6 each): each
    row of the fused step gives, bit for bit, the logits of a cache fed its tokens alone."""
    from kvlm.engine.runner import CacheBatch

    cache = llm.new_cache("contiguous")
    llm.runner.forward(prompt, cache)
    cache.fork(3)
    assert llm.runner.fused_for(cache) is not None
    rows = [more[b::3][:6] for b in range(3)]
    together = torch.stack([llm.runner.run(CacheBatch([[r[i]] for r in rows], cache))
                            for i in range(6)], dim=1)  # fmt: skip
    for b, tokens in enumerate(rows):
        alone = llm.new_cache("contiguous")
        llm.runner.forward(prompt, alone)
        assert torch.equal(together[b], torch.stack([llm.runner.forward([t], alone)
                                                     for t in tokens])), b  # fmt: skip


def a_refused_pool_step(llm):
    """Two requests of `llm` decoding on a fresh engine's pool, and their next step two
    ways: `step(good)` runs it as a PoolBatch, with good tables (True) or with row 1's
    table a block short (False: the fused step refuses it, ValueError). Returns (engine,
    step, the rows' starts, the other groups' tables)."""
    from kvlm.engine.runner import PoolBatch

    engine = fresh_engine(llm)
    for i, p in enumerate(POOL_PROMPTS[:2]):
        engine.add_request(str(i), llm.tokenizer.encode(p), GREEDY)
    while len(engine.scheduler.running) < 2 or any(s.prefilling for s in engine.scheduler.running):
        engine.step()
    seqs = engine.scheduler.running
    rows = [[s.token_ids[-1]] for s in seqs]
    starts = [s.num_computed for s in seqs]
    blocks, others = engine.backend._where([s.table for s in seqs])
    bad = [list(blocks[0]), blocks[1][: starts[1] // 16]]  # row 1's table a block short

    def step(good: bool):
        tables = blocks if good else bad
        return llm.runner.run(PoolBatch(rows, engine.pool, engine.spec, tables, starts, others))

    return engine, step, starts, others


def assert_top_k_both_ways(a: torch.Tensor, b: torch.Tensor, k: int = 5) -> None:
    """At every step each side's best token is in the other's top k (the top-k rule, for
    teacher-forced steps)."""
    for i, (x, y) in enumerate(zip(a, b, strict=True)):
        assert int(x.argmax()) in torch.topk(y, k).indices.tolist(), f"step {i}"
        assert int(y.argmax()) in torch.topk(x, k).indices.tolist(), f"step {i}"


def feed_batched(llm, seqs: list[list[int]], pool, tables, windowed=()) -> list[torch.Tensor]:
    """Feed every row its tokens one step at a time through the runner's batch over a
    paged pool (the engine's path), all rows that still have one together; each row's
    logits per step. `windowed`: a hybrid pool's other groups' tables (kvlm.cache.paged),
    windowed[g - 1][b]."""
    from kvlm.engine.runner import PoolBatch

    spec = llm.cache_spec("paged")
    out: list[list[torch.Tensor]] = [[] for _ in seqs]
    for t in range(max(len(s) for s in seqs)):
        live = [b for b, s in enumerate(seqs) if t < len(s)]
        rows, starts = [[seqs[b][t]] for b in live], [t] * len(live)
        batch = PoolBatch(rows, pool, spec, [tables[b] for b in live], starts,
                          [[w[b] for b in live] for w in windowed])  # fmt: skip
        logits = llm.runner.run(batch)
        for i, b in enumerate(live):
            out[b].append(logits[i])
    return [torch.stack(o) for o in out]


def feed_contiguous(llm, tokens: list[int]) -> torch.Tensor:
    """The tokens one at a time through the fused step over a contiguous cache."""
    cache = llm.new_cache("contiguous")
    assert llm.runner.fused_for(cache) is not None
    return torch.stack([llm.runner.forward([t], cache) for t in tokens])


def fail_schedule_at(engine, monkeypatch, call: int) -> None:
    """Make the engine's scheduler raise on its `call`-th schedule (a scheduler bug)."""
    real = engine.scheduler.schedule
    calls = {"n": 0}

    def schedule():
        calls["n"] += 1
        if calls["n"] == call:
            raise RuntimeError("simulated scheduler bug")
        return real()

    monkeypatch.setattr(engine.scheduler, "schedule", schedule)


def scrambled_tables(pool, lengths: list[int], seed: int) -> list[list[int]]:
    """Each row's blocks, drawn from the pool in a scrambled order (ids far from sorted)."""
    import random

    from kvlm.cache.paged import blocks_for

    ids = [pool.allocate() for _ in range(sum(blocks_for(n, pool.block_size) for n in lengths))]
    random.Random(seed).shuffle(ids)
    tables, at = [], 0
    for n in lengths:
        k = blocks_for(n, pool.block_size)
        tables.append(ids[at : at + k])
        at += k
    return tables


def break_sampler(monkeypatch, top_k: int = 13) -> None:
    """The engine's sampler raises for requests with this top_k (a bad request's mark)."""
    from kvlm.engine import engine as engine_module

    real = engine_module.Sampler

    class Broken(real):
        def __call__(self, logits, argmax=None):
            if self.params.top_k == top_k:
                raise IndexError("simulated sampler bug")
            return super().__call__(logits)

    monkeypatch.setattr(engine_module, "Sampler", Broken)


# (sequence, position of its first token fed, tokens fed, a chunk, every row's logits):
# a chunk after a prefix, a fresh prompt scored whole, a decode row, a draft's three rows
# of one sequence (consecutive positions, one table), a one-token chunk
MIXED_ROWS = [
    (0, 5, 6, True, False),
    (1, 0, 9, True, True),
    (2, 11, 1, False, False),
    (3, 7, 1, False, False),
    (3, 8, 1, False, False),
    (3, 9, 1, False, False),
    (4, 3, 1, True, False),
]


def mixed_step(llm, one_forward: bool, seed: int = 0) -> list[torch.Tensor]:
    """Prefill what each sequence holds before MIXED_ROWS (a forward each), then run them as
    one engine step through the pool backend (kvlm.engine.backends.PoolBackend.forward,
    tests/test_one_forward.py): one ragged forward (`one_forward`), or the road it takes
    without one, a forward per chunk and one for the decode rows; each row's logits."""
    from types import SimpleNamespace

    from kvlm.cache.paged import BlockPool
    from kvlm.cache.prefix import BlockManager, BlockTable
    from kvlm.engine.backends import Chunk, PoolBackend
    from kvlm.engine.runner import PoolBatch

    spec = llm.cache_spec("paged")
    pool = BlockPool(spec, 64)
    gen = torch.Generator().manual_seed(seed)
    n_seqs = 1 + max(r[0] for r in MIXED_ROWS)
    length = [max(p + n for s, p, n, *_ in MIXED_ROWS if s == i) for i in range(n_seqs)]
    held = [min(p for s, p, *_ in MIXED_ROWS if s == i) for i in range(n_seqs)]
    tokens = [torch.randint(3, llm.config.vocab_size, (n,), generator=gen).tolist() for n in length]
    tables = scrambled_tables(pool, length, seed)
    # a hybrid pool's windowed groups: a whole table each too (nothing left the window)
    windowed = [scrambled_tables(group, length, seed) for group in pool.groups[1:]]
    for i in range(n_seqs):
        if held[i]:
            prefix = PoolBatch([tokens[i][: held[i]]], pool, spec, [tables[i]], [0],
                               [[w[i]] for w in windowed])  # fmt: skip
            llm.runner.run(prefix)
    # the step's sequences as the backend reads them: a chunk's start and table; a decode
    # row's last token at num_computed, a sequence's further rows its draft
    chunks, decoding = [], {}
    for s, p, n, chunk, every in MIXED_ROWS:
        table = BlockTable(tables[s], others=[w[s] for w in windowed])
        if chunk:
            seq = SimpleNamespace(table=table, num_computed=p)
            chunks.append(Chunk(seq, tokens[s][p : p + n], every))
            continue
        seq = decoding.setdefault(s, SimpleNamespace(
            table=table, num_computed=p, token_ids=tokens[s][: p + 1], draft=[]
        ))  # fmt: skip
        if p > seq.num_computed:
            seq.draft.append(tokens[s][p])
    backend = PoolBackend(llm.runner, BlockManager(pool, prefix_caching=False), spec)
    saved, llm.runner.one_forward = llm.runner.one_forward, one_forward
    try:
        assert llm.runner.ragged_steps() == one_forward, "its rows cannot share one forward"
        out = backend.forward(chunks, list(decoding.values()))
    finally:
        llm.runner.one_forward = saved
    results = [*out.prefilled, *out.decoded]
    bad = [r for r in results if isinstance(r, Exception)]
    if bad:
        raise bad[0]
    prefilled, decoded = iter(out.prefilled), dict(zip(decoding, out.decoded, strict=True))
    return [next(prefilled) if chunk else decoded[s][p - decoding[s].num_computed]
            for s, p, _, chunk, _ in MIXED_ROWS]  # fmt: skip


def fused_draft_rolled_back(llm, ids: list[int], draft: list[int], reject: int, monkeypatch):
    """The last of `ids` and `draft` checked as rows of one fused step on a contiguous
    cache `a` that holds ids[:-1], `reject` of them rolled back, against a cache `b` fed
    the kept tokens one at a time through the fused step: each kept row's logits bit for
    bit the row's alone. Returns (a, b), for the caller's checks of what they hold."""
    from kvlm.engine.runner import DraftBatch

    a, b = llm.new_cache("contiguous"), llm.new_cache("contiguous")
    for cache in (a, b):
        llm.runner.forward(ids[:-1], cache)  # the prefill (torch)
    calls, n = counted_fused_runs(monkeypatch), len(draft) + 1
    rows = llm.runner.run(DraftBatch([ids[-1], *draft], a))
    assert calls == [n]
    a.rollback(reject)
    kept = [ids[-1], *draft][: n - reject]
    alone = torch.stack([llm.runner.forward([t], b) for t in kept])
    assert calls == [n] + [1] * len(kept)
    assert torch.equal(rows[: len(kept)], alone)
    return a, b


def alone_on_cache(llm, prompts, params=None) -> list[list[list[int]]]:
    """Each prompt's tokens alone on the LLM's one-sequence cache (its own fused step),
    under `params` (None: GREEDY)."""
    params = GREEDY if params is None else params
    return [[llm.generate(p, params)[0].outputs[0].token_ids] for p in prompts]


def assert_all_fused(calls: list[int], engine) -> None:
    """Every decode row of `engine` went through the fused step (`calls`:
    counted_fused_runs')."""
    assert engine.decode_step == "fused"
    assert engine.stats.decode_rows > 0 and sum(calls) >= engine.stats.decode_rows


def assert_pool_fused_as_alone(llm, monkeypatch, draft_weights: str, after=None) -> None:
    """The fused step on the engine's pool of `llm`: POOL_PROMPTS batched, n = 2 (forked
    slots), prompt lookup's drafts and a draft model's of `draft_weights` (some rejected,
    rolled back) each give every prompt's tokens alone, every decode row (a draft's
    rows too) through the fused step; `after(engine)`: the caller's check of each engine
    but the speculative ones."""
    from kvlm import SamplingParams
    from kvlm.engine.speculative import SpeculativeConfig

    want = alone_on_cache(llm, POOL_PROMPTS)
    calls = counted_fused_runs(monkeypatch)
    n2 = SamplingParams(n=2, max_tokens=20, temperature=0.0, ignore_eos=True)
    for params, tokens in ((GREEDY, want), (n2, [w * 2 for w in want])):
        calls.clear()
        got, engine = on_pool(llm, POOL_PROMPTS, params)
        assert got == tokens
        assert_all_fused(calls, engine)
        if after is not None:
            after(engine)
        if params is GREEDY:
            assert sum(calls) == engine.stats.decode_rows and max(calls) == len(POOL_PROMPTS)
    rolled_back = 0
    for spec in (SpeculativeConfig("ngram", num_draft=4, ngram_min=1),
                 SpeculativeConfig("draft", draft_weights=draft_weights)):  # fmt: skip
        calls.clear()
        drafted, engine = on_pool(llm, POOL_PROMPTS, GREEDY, speculative=spec)
        st = engine.stats.spec
        assert drafted == want
        rolled_back += st.drafted - st.accepted
        assert_all_fused(calls, engine)
        assert sum(calls) > engine.stats.decode_rows  # the drafts' rows went through it
    # some rows rolled back (which drafter's depends on the CPU's numerics: on an AMX Xeon
    # the int8 draft model's 48 drafts were all accepted, prompt lookup's 8 all rejected)
    assert rolled_back > 0
    assert st.accepted > 0  # the draft model's: rows of a draft checked as one sequence


def counted_fused_runs(monkeypatch) -> list[int]:
    """The rows of every FusedDecoder.run call from now on."""
    from kvlm.model.fused import FusedDecoder

    calls: list[int] = []
    fused_run = FusedDecoder.run

    def counted(self, views, tokens, *args):
        calls.append(len(tokens))
        return fused_run(self, views, tokens, *args)

    monkeypatch.setattr(FusedDecoder, "run", counted)
    return calls


def staggered_answers(engine, prompts: list[list[int]], params) -> dict[str, list]:
    """One more request a step (so prompt chunks meet decode rows) until `engine` has no
    work: each request's (token, its top logprob ids) in order."""
    out: dict[str, list] = {}
    for step in range(400):
        if step < len(prompts):
            engine.add_request(str(step), prompts[step], params)
        if not engine.has_work():
            break
        for ev in engine.step():
            out.setdefault(ev.request_id, []).extend(
                (t, list(lp.top)) for t, lp in zip(ev.token_ids, ev.logprobs, strict=True)
            )
    return out


def refused(read, good: dict, bad: dict, said: str):
    """A family's config test: `read(good, name)` (config_from_hf or config_from_gguf)
    reads, and `bad` (good with a hostile key) is refused in one ModelLoadError or
    UnsupportedModelError naming `said`; returns good's config."""
    import pytest

    from kvlm.errors import ModelLoadError, UnsupportedModelError

    config = read(good, "m")
    with pytest.raises((ModelLoadError, UnsupportedModelError), match=said):
        read(bad, "m")
    return config


def gguf_as_folder(path, folder):
    """The converted GGUF at `path` and its HF `folder`, each an exact kv-off LLM, their
    configs held equal (but the name, and the epsilon the file stores in fp32)."""
    from dataclasses import replace

    import pytest

    from kvlm import LLM

    from_gguf = LLM(model=path, kv="off", exact=True, progress=False)
    from_hf = LLM(model=folder, kv="off", exact=True, progress=False)
    a, b = from_gguf.config, from_hf.config
    assert a.rms_norm_eps == pytest.approx(b.rms_norm_eps, rel=1e-7)
    assert replace(a, name="", rms_norm_eps=0.1) == replace(b, name="", rms_norm_eps=0.1)
    return from_gguf, from_hf


# the pool tests' prompts, of different lengths: inside one block of 16, across several,
# and one longer; and their greedy sampling
POOL_PROMPTS = [FRANCE, "One two three, one two three, one two", FRANCE * 4 + " Paris. And"]


def _greedy():
    from kvlm import SamplingParams

    return SamplingParams(max_tokens=20, temperature=0.0, ignore_eos=True)


GREEDY = _greedy()


def answer(engine, ids: list[int], params=GREEDY, turn_start=None) -> tuple[list[int], int]:
    """One request through `engine` to its end: its tokens and its cached prompt tokens
    (`turn_start`: Engine.add_request's)."""
    rid = f"r{engine.stats.requests_added}"
    engine.add_request(rid, ids, params, turn_start=turn_start)
    out, cached = [], 0
    while engine.has_work():
        for ev in engine.step():
            out += ev.token_ids
            cached = ev.cached_tokens
    return out, cached


def conversation(llm) -> tuple[list[int], list[int]]:
    """A chat's first turn and its second (the first, its answer, a new question)."""
    first = [{"role": "user", "content": "Name a city in France, then one in Spain."}]
    ids = llm.tokenizer.encode_chat(first)
    reply = llm.tokenizer.decode(answer(fresh_engine(llm), ids)[0])
    second = [*first, {"role": "assistant", "content": reply},
              {"role": "user", "content": "And one in Italy?"}]  # fmt: skip
    return ids, llm.tokenizer.encode_chat(second)


def conversation_on_a_tier(llm, folder: Path):
    """A chat's first turn answered through a fresh engine on a disk tier in `folder`
    (closed: its writes flushed), for a restarted engine to find: (the first turn, the
    second, the second's answer from a fresh pool, the tier, the writer engine)."""
    first, second = conversation(llm)
    want = answer(fresh_engine(llm), second)[0]
    tier = (f"disk:{folder}",)
    writer = fresh_engine(llm, kv_tiers=tier)
    answer(writer, first)
    writer.close()
    return first, second, want, tier, writer


def fresh_engine(llm, **config):
    from kvlm.engine.engine import Engine, EngineConfig

    return Engine(llm, EngineConfig(**config))


def fed(llm, ids: list[int], chunks: list[int], cache=None):
    """Teacher-forced logits of `ids` fed in `chunks` through the runner and a cache of the
    LLM's (its state, a conv group's rows or a DeltaNet's, is the cache's), each chunk a
    prompt's, as the engine feeds a chunked prefill (a one-token chunk too: a decoded
    token's row takes the decode road, kvlm_attend_row on the CPU, whose sums run in
    another order)."""
    from kvlm.engine.runner import CacheBatch

    cache = cache if cache is not None else llm.new_cache()
    out, at = [], 0
    for n in chunks:
        out.append(llm.runner.run(CacheBatch([ids[at : at + n]], cache, prompt=True,
                                             all_rows=True))[0])  # fmt: skip
        at += n
    return torch.cat(out)


def on_pool(llm, prompts, params, **config) -> tuple[list[list[list[int]]], object]:
    """Each prompt's samples' tokens through an engine on the pool (EngineConfig(**config),
    the scheduler's fields under `scheduler`), and the engine."""
    from kvlm.engine.batch import run_batch
    from kvlm.engine.engine import Engine, EngineConfig
    from kvlm.engine.scheduler import SchedulerConfig

    sched = SchedulerConfig(**config.pop("scheduler", {}))
    engine = Engine(llm, EngineConfig(scheduler=sched, **config))
    texts = [(p, llm.tokenizer.encode(p)) for p in prompts]
    outs = run_batch(engine, texts, [params] * len(prompts), _NoBar())
    return [[o.token_ids for o in r.outputs] for r in outs], engine


class _NoBar:
    def update(self, n: int) -> None: ...
    def set_postfix_str(self, text: str, refresh: bool = False) -> None: ...


def staggered_on_pool(llm, prompts: list[list[int]], params, chunk: int, one_forward: bool):
    """staggered_answers through a fresh engine on `llm`'s pool (prompts in chunks of
    `chunk`), with one ragged forward a step (`one_forward`, the GPU's road) or a forward
    a chunk: (the answers, the engine)."""
    from kvlm.engine.engine import Engine, EngineConfig
    from kvlm.engine.scheduler import SchedulerConfig

    engine = Engine(llm, EngineConfig(scheduler=SchedulerConfig(prefill_chunk=chunk)))
    engine.runner.one_forward = one_forward
    try:
        return staggered_answers(engine, prompts, params), engine
    finally:
        engine.runner.one_forward = False


def assert_ragged_agrees(ragged: dict[str, list], split: dict[str, list], n: int) -> None:
    """Each request's n greedy tokens of one ragged forward a step against a forward a
    chunk, by the top-5 rule: at the first divergence each token is in the other's top 5."""
    for rid, got in split.items():
        want = ragged[rid]
        assert len(got) == len(want) == n
        for i, ((a, a_top), (b, b_top)) in enumerate(zip(got, want, strict=True)):
            if a != b:  # the first divergence: each in the other's top 5, then stop
                assert a in b_top and b in a_top, (rid, i)
                break


def with_mtp(folder, dest):
    """A copy of `folder` with a multi-token-prediction head (`mtp.*`, random weights of
    an attention block's shapes; `mtp_num_hidden_layers` 1) as Qwen3.5's checkpoints
    have, which llama.cpp's converter needs unless told --no-mtp."""
    import shutil

    from safetensors.torch import load_file, save_file

    shutil.copytree(folder, dest)
    weights = load_file(dest / "model.safetensors")
    g = torch.Generator().manual_seed(7)
    config = json.loads((dest / "config.json").read_text())
    attention = config["layer_types"].index("full_attention")
    block = {k.split(f"layers.{attention}.", 1)[1]: v for k, v in weights.items()
             if f".layers.{attention}." in k}  # fmt: skip
    hidden = config["hidden_size"]
    mtp = {f"mtp.layers.0.{k}": v.shape for k, v in block.items()}
    mtp |= {"mtp.fc.weight": (hidden, 2 * hidden)}
    mtp |= {f"mtp.{n}.weight": (hidden,) for n in ("norm", "pre_fc_norm_embedding",
                                                     "pre_fc_norm_hidden")}  # fmt: skip
    weights |= {k: 0.1 * torch.randn(shape, generator=g) for k, shape in mtp.items()}
    save_file(weights, dest / "model.safetensors", metadata={"format": "pt"})
    (dest / "config.json").write_text(json.dumps({**config, "mtp_num_hidden_layers": 1}))
    return dest


# An experts model's routers times this: a random router's logits are nearly flat, so
# its top 2 of 8 often nearly tie, and the fused step's int8 queries (an int8 K/V's
# attention differs from the torch step's by ~0.03 in the logits) flipped such a tie at 2
# of 20 steps, moving the logits by ~4 (a whole expert's output). Four times the spread
# is still a router of random weights, its ties rarer; the fused cells then hold it to
# the torch step by the top-5 rule as the dense models'. (Measured on this model, Zen 4:
# unscaled 2 flips in 20 steps at int8 K/V; x4 and x8 none, largest step 0.16 and 0.30.)
ROUTER_SCALE = 4.0


def sharpen_routers(folder, scale: float = ROUTER_SCALE) -> None:
    """Each router (`mlp.gate`, `mlp.router`, `feed_forward.gate`) of the saved model in
    `folder` times `scale`: a random router's logits are nearly flat, its top k near ties
    that any rounding flips (a whole expert's output); sharpened, it is still random, its
    ties rarer."""
    from safetensors.torch import load_file, save_file

    path = folder / "model.safetensors"
    tensors = load_file(path)
    routers = (".mlp.gate.weight", ".mlp.router.weight", ".feed_forward.gate.weight")
    for name in [n for n in tensors if n.endswith(routers)]:
        tensors[name] = tensors[name] * scale
    save_file(tensors, path, metadata={"format": "pt"})


# The layer kinds of [20]-[22] as tiny random models (save_tiny_model): short convolutions
# beside attention (LFM2), gated DeltaNets (Qwen3.5) and Mamba2 (Granite 4.0-H) with their
# recurrent states, and experts: name -> (arch, seed, overrides). tests/test_gpu.py runs
# each on the device, tests/test_experts_device.py the experts' device road on the CPU.
LAYER_KIND_FAMILIES = {
    "lfm2": ("lfm2", 20, {"tokenizer": "llama3"}),
    "qwen3_5": ("qwen3_5", 30, {"tokenizer": "qwen35"}),
    "granite-h": ("granitemoehybrid", 42, {}),
    "qwen3_moe": ("qwen3_moe", 40, {"tokenizer": "qwen35"}),
    "qwen3_5_moe": ("qwen3_5_moe", 50, {"tokenizer": "qwen35"}),
    "lfm2_moe": ("lfm2_moe", 60, {"tokenizer": "llama3"}),  # a sigmoid router, a bias
    "gpt_oss": ("gpt_oss", 70, {"tokenizer": "qwen35"}),  # sinks, windows, clamped SwiGLU
    "olmoe": ("olmoe", 80, {"tokenizer": "qwen35"}),  # q/k norms over the projections
}
EXPERT_FAMILIES = {"qwen3_moe", "qwen3_5_moe", "lfm2_moe", "gpt_oss", "olmoe"}


def family_maker(tmp_path_factory):
    """A fixture's factory: name in LAYER_KIND_FAMILIES -> its folder, made once; the
    experts' routers sharpened (sharpen_routers: routing decisive enough for a GPU's sums)."""
    made: dict[str, Path] = {}

    def make(name: str) -> Path:
        if name not in made:
            arch, seed, overrides = LAYER_KIND_FAMILIES[name]
            made[name] = save_tiny_model(tmp_path_factory.mktemp(name), arch, seed=seed,
                                         **overrides)  # fmt: skip
            if name in EXPERT_FAMILIES:
                sharpen_routers(made[name])
        return made[name]

    return make


def assert_kind_refuses_short_buffers(q, kind: str, n: int, k: int) -> None:
    """A low-bit weight `q` of `kind` (n rows of k): every product and dequantizing entry
    point takes its shape's buffers (0) and refuses (-2, nothing read or written) one a
    byte or an element shorter, a width that is not whole groups, a bf16 flag of 2, and a
    row past the weight's."""
    import torch

    from kvlm import kernels
    from kvlm.model import quant

    lib, code = kernels.library(), quant.KIND_CODES[kind]
    w, wn = q.data.data_ptr(), q.data.numel()
    x, y = torch.randn(3, k), torch.empty(3, n)
    xp, yp = x.data_ptr(), y.data_ptr()
    for fine in (None, 0, 1):

        def product(xn, wn_, yn, kk=k, fine=fine):
            args = (code, xp, xn, 3, kk, w, wn_, n, yp, yn, n)
            return lib.kvlm_qgemm(*args) if fine is None else lib.kvlm_qgemm_i8(*args, fine)

        assert product(3 * k, wn, 3 * n) == 0
        assert product(3 * k - 1, wn, 3 * n) == -2
        assert product(3 * k, wn - 1, 3 * n) == -2
        assert product(3 * k, wn, 3 * n - 1) == -2
        assert product(3 * 48, wn, 3 * n, kk=48) == -2  # 48: not whole groups
    out = torch.empty(n, k)
    assert lib.kvlm_qdequant(code, 0, k, w, wn, n, out.data_ptr(), 4 * n * k) == 0
    assert lib.kvlm_qdequant(code, 0, k, w, wn - 1, n, out.data_ptr(), 4 * n * k) == -2
    assert lib.kvlm_qdequant(code, 0, k, w, wn, n, out.data_ptr(), 4 * n * k - 1) == -2
    assert lib.kvlm_qdequant(code, 2, k, w, wn, n, out.data_ptr(), 4 * n * k) == -2  # bf16 2
    ids = torch.tensor([0, n - 1])
    args = (code, k, w, wn, n, ids.data_ptr(), 2, out.data_ptr())
    assert lib.kvlm_qdequant_rows(*args, 2 * k) == 0
    assert lib.kvlm_qdequant_rows(*args, 2 * k - 1) == -2
    assert lib.kvlm_qdequant_rows(code, k, w, wn - 1, n, ids.data_ptr(), 2, out.data_ptr(),
                                  2 * k) == -2  # fmt: skip
    bad = torch.tensor([0, n])
    assert lib.kvlm_qdequant_rows(code, k, w, wn, n, bad.data_ptr(), 2, out.data_ptr(),
                                  2 * k) == -2  # fmt: skip
