"""BERT, RoBERTa and XLM-RoBERTa encoders (HF's BertModel, RobertaModel, XLMRobertaModel): embedding models
such as all-MiniLM, bge-*-en-v1.5, e5-*-v2, all-roberta-large-v1, bge-m3 and multilingual-e5; and their
...ForSequenceClassification heads: cross-encoder rerankers such as ms-marco-MiniLM (BERT) and
bge-reranker-base / -v2-m3 (XLM-RoBERTa). Run only by the pooling runner.

Word + absolute position + token-type embeddings, LayerNorm; post-LN encoder layers (self-attention with
biases, then a GELU MLP, each added to the stream and normalised); bidirectional attention within each
prompt (``is_causal`` False: the runner attends with torch_ref, the scheduler runs each prompt whole in one
step and prefix caching is off). (XLM-)RoBERTa numbers positions from ``pad_token_id + 1``, as transformers'
``create_position_ids_from_input_ids`` does for unpadded inputs. Every token of an embedding model is of
type 0 (one segment); a BERT classifier reads a sentence pair's second segment, the tokens after the
prompt's first [SEP], as type 1 (segment_types), as its tokenizer's pair encoding marks them.
"""

from __future__ import annotations

import re
from collections.abc import Iterable

import torch
import torch.nn.functional as F
from torch import nn

from plait.config import ModelConfig
from plait.layers.activation import get_activation
from plait.layers.linear import Linear
from plait.models.weights import load_checked
from plait.runner.forward_batch import ForwardBatch

# transformers' BertConfig default.
DEFAULT_LAYER_NORM_EPS = 1e-12
# HF names q/k/v "query", "key", "value": fused at load into one projection.
STACKED_QKV = {"query": ("qkv", 0), "key": ("qkv", 1), "value": ("qkv", 2)}
# Checkpoint tensors the model does not use: BertModel's own pooler head (sentence-transformers pools the
# hidden states instead) and the position-id buffers older checkpoints saved.
SKIPPED = re.compile(r"^pooler\.|position_ids$|token_type_ids$")
# The trunk's prefix in checkpoints saved from a model with a head (BertForMaskedLM's "bert.", ...).
TRUNK_PREFIXES = ("bert.", "roberta.")
ROBERTA_MODEL_TYPES = ("xlm-roberta", "roberta")


def position_offset(hf_config: dict) -> int:
    """The position-embedding row of a prompt's first token: ``pad_token_id + 1`` for (XLM-)RoBERTa, else
    0."""
    if hf_config.get("model_type") in ROBERTA_MODEL_TYPES:
        return int(hf_config.get("pad_token_id", 1)) + 1
    return 0


class BertEmbeddings(nn.Module):
    def __init__(self, cfg: ModelConfig, eps: float) -> None:
        super().__init__()
        raw = cfg.raw
        self.word_embeddings = nn.Embedding(cfg.vocab_size, cfg.hidden_size)
        self.position_embeddings = nn.Embedding(raw["max_position_embeddings"], cfg.hidden_size)
        self.token_type_embeddings = nn.Embedding(raw.get("type_vocab_size", 2), cfg.hidden_size)
        self.LayerNorm = nn.LayerNorm(cfg.hidden_size, eps=eps)
        self.position_offset = position_offset(raw)

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor,
                token_types: torch.Tensor | None = None) -> torch.Tensor:
        # input_ids, positions, token_types: [T] -> [T, hidden]; no token_types: every token of type 0
        x = self.word_embeddings(input_ids) + self.position_embeddings(positions + self.position_offset)
        table = self.token_type_embeddings
        return self.LayerNorm(x + (table.weight[0] if token_types is None else table(token_types)))


def segment_types(input_ids: torch.Tensor, separator_id: int, batch: ForwardBatch) -> torch.Tensor:
    """Each token's segment in its prompt: 0 up to and including the prompt's first ``separator_id``, 1 after
    it, as a BERT tokenizer's pair encoding ([CLS] a [SEP] b [SEP]) gives token_type_ids."""
    # input_ids: [T] -> [T] int64 (tokens past the batch's rows: 0)
    starts = batch.query_start_loc.long()
    n = int(starts[-1])
    is_sep = (input_ids[:n] == separator_id).long()
    before = is_sep.cumsum(0) - is_sep  # separators before each token, from the batch's first
    row = torch.repeat_interleave(torch.arange(batch.num_rows, device=input_ids.device), starts.diff(),
                                  output_size=n)
    types = torch.zeros_like(input_ids)
    types[:n] = (before - before[starts[:-1]][row] > 0).long()  # separators before it within its prompt
    return types


class BertLayer(nn.Module):
    """One post-LN encoder layer, under HF's module names (attention.self / attention.output /
    intermediate / output), q/k/v fused into ``attention.self.qkv``."""

    def __init__(self, cfg: ModelConfig, layer_idx: int, eps: float) -> None:
        super().__init__()
        hidden = cfg.hidden_size
        self.layer_idx = layer_idx
        self.num_heads, self.head_dim = cfg.num_attention_heads, cfg.head_dim
        self.attention = nn.Module()
        self.attention.self = nn.Module()
        self.attention.self.qkv = Linear(hidden, 3 * hidden)
        self.attention.output = nn.Module()
        self.attention.output.dense = Linear(hidden, hidden)
        self.attention.output.LayerNorm = nn.LayerNorm(hidden, eps=eps)
        self.intermediate = nn.Module()
        self.intermediate.dense = Linear(hidden, cfg.intermediate_size)
        self.output = nn.Module()
        self.output.dense = Linear(cfg.intermediate_size, hidden)
        self.output.LayerNorm = nn.LayerNorm(hidden, eps=eps)
        self.act = get_activation(cfg.hidden_act)

    def forward(self, x: torch.Tensor, batch: ForwardBatch) -> torch.Tensor:
        # x: [T, hidden] -> [T, hidden]
        q, k, v = self.attention.self.qkv(x).view(-1, 3, self.num_heads, self.head_dim).unbind(1)
        attn = batch.attention(self.layer_idx, q, k, v, self.head_dim**-0.5, causal=False).flatten(1)
        x = self.attention.output.LayerNorm(x + self.attention.output.dense(attn))
        return self.output.LayerNorm(x + self.output.dense(self.act(self.intermediate.dense(x))))


class BertModel(nn.Module):
    """BertModel, RobertaModel and XLMRobertaModel: the encoder's last hidden states, which the pooling runner
    pools (CLS by default, as vLLM pools them, or the sentence-transformers folder's mode)."""

    is_causal = False  # every token sees its whole prompt
    supports_prefix_caching = False
    supports_lora = False
    default_pooling_type = "CLS"

    def __init__(self, cfg: ModelConfig, max_positions: int) -> None:
        super().__init__()
        self.config = cfg
        eps = float(cfg.raw.get("layer_norm_eps", DEFAULT_LAYER_NORM_EPS))
        self.embeddings = BertEmbeddings(cfg, eps)
        self.encoder = nn.Module()
        self.encoder.layer = nn.ModuleList(BertLayer(cfg, i, eps) for i in range(cfg.num_hidden_layers))
        self.lm_head = None

    # The [SEP] id after which a prompt's tokens are its second segment (segment_types), set by the runner
    # from the tokenizer for models that read segments; None: every token of type 0.
    segment_separator_id: int | None = None
    reads_segments = False  # a BERT cross-encoder's pairs

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor, batch: ForwardBatch) -> torch.Tensor:
        # input_ids, positions: [T] -> hidden: [T, hidden]
        separator = self.segment_separator_id
        types = None if separator is None else segment_types(input_ids, separator, batch)
        x = self.embeddings(input_ids, positions, types)
        for layer in self.encoder.layer:
            x = layer(x, batch)
        return x

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        raise ValueError(f"{self.config.architecture} is an encoder: it has no LM head to give logits")

    # Checkpoint tensors this model does not use (a classifier keeps BERT's pooler).
    skipped = SKIPPED

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> None:
        """HF-named tensors (with or without a ``bert.`` / ``roberta.`` prefix), q/k/v fused; the pooler head
        is skipped. Every parameter must be covered."""
        hidden = self.config.hidden_size

        def rename(name: str) -> str | None:
            for prefix in TRUNK_PREFIXES:
                name = name.removeprefix(prefix)
            return None if self.skipped.search(name) else name

        load_checked(self, weights, STACKED_QKV, {"qkv": [hidden] * 3}, rename)


class BertForSequenceClassification(BertModel):
    """BERT's classifier (a cross-encoder reranker such as ms-marco-MiniLM): the encoder, BERT's pooler
    (dense + tanh) at the [CLS] token, then ``classifier`` (hidden -> num_labels); a pair's second segment
    read as type 1. The pooling runner pools the [CLS] state and calls ``classify``."""

    reads_segments = True
    skipped = re.compile(r"position_ids$|token_type_ids$")

    def __init__(self, cfg: ModelConfig, max_positions: int) -> None:
        super().__init__(cfg, max_positions)
        from plait.models.llama import num_labels

        self.pooler = nn.Module()
        self.pooler.dense = Linear(cfg.hidden_size, cfg.hidden_size)
        self.classifier = Linear(cfg.hidden_size, num_labels(cfg.raw))

    def classify(self, pooled: torch.Tensor) -> torch.Tensor:
        # pooled: [n, hidden] fp32 ([CLS]) -> logits: [n, num_labels] fp32
        return _tanh_head(pooled, self.pooler.dense, self.classifier)


class RobertaForSequenceClassification(BertModel):
    """(XLM-)RoBERTa's classifier (a cross-encoder reranker such as bge-reranker-base / -v2-m3): the encoder,
    then RoBERTa's head at the <s> token: ``classifier.dense`` + tanh, ``classifier.out_proj`` (hidden ->
    num_labels). One token type, as RoBERTa has."""

    def __init__(self, cfg: ModelConfig, max_positions: int) -> None:
        super().__init__(cfg, max_positions)
        from plait.models.llama import num_labels

        self.classifier = nn.Module()
        self.classifier.dense = Linear(cfg.hidden_size, cfg.hidden_size)
        self.classifier.out_proj = Linear(cfg.hidden_size, num_labels(cfg.raw))

    def classify(self, pooled: torch.Tensor) -> torch.Tensor:
        # pooled: [n, hidden] fp32 (<s>) -> logits: [n, num_labels] fp32
        return _tanh_head(pooled, self.classifier.dense, self.classifier.out_proj)


def _tanh_head(pooled: torch.Tensor, dense: Linear, out: Linear) -> torch.Tensor:
    """out(tanh(dense(pooled))) in fp32: BERT's pooler and classifier, RoBERTa's classification head (a head
    of a few rows: fp32 costs nothing)."""
    x = torch.tanh(F.linear(pooled, dense.weight.float(), dense.bias.float()))
    return F.linear(x, out.weight.float(), out.bias.float())

