"""The draft along a text the target produced: what each draft step would say at each position.

Decoding and the TTT unroll are one computation (replay.py): a chain whose last verified
position is t drafts, at step j, what the unroll says at position t, step j. So one unroll over
an engine's own output tells, for every round that could start anywhere in it, which drafted
tokens the target would accept and how sure the draft was of each. ``simulate`` then walks any
chain shape over it without decoding again. A DFlash draft's trace (``trace_blocks``) has the same
shape: the block anchored right after position t drafts, at its position j + 1, what step j says.

Shapes: S draft steps, T tokens, Vd draft vocabulary, V target vocabulary.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from eaglewire.model.boundary_capture import capture
from eaglewire.model.dflash import DFlashDraft
from eaglewire.model.dflash_blocks import anchored_blocks, draft_lm_head, drafted_index, mask_embedding
from eaglewire.model.draft import Eagle3Draft
from eaglewire.model.target import Target
from eaglewire.model.ttt import shift_left

LLAMACPP_TOP_K = 10  # llama.cpp's EAGLE-3 and DFlash draft samplers keep the top 10 and renormalise
HEAD_ROWS = 512  # drafted rows through the target's lm_head at once ([n, V] logits)


@dataclass
class DraftTrace:
    """One text (prompt + output) seen through the draft's unroll."""

    prompt_len: int
    right: torch.Tensor  # [S, T] bool: step j at t drafts text[t + 2 + j]
    prob: torch.Tensor  # [S, T] the draft's top probability over its vocabulary
    prob_top: torch.Tensor  # [S, T] the same renormalised over its top LLAMACPP_TOP_K
    target_prob: torch.Tensor  # [S, T] the target's probability of the drafted token (at the temperature)
    block: bool = False  # True: a DFlash block drafted every step in one pass (trace_blocks)
    # [S, T] the drafted token is the target's argmax: its target_prob at temperature 0 (a trace at T > 0 holds
    # both, so greedy and sampled acceptance come from one unroll); None where not traced
    target_agrees: torch.Tensor | None = None

    @property
    def steps(self) -> int:
        return self.right.shape[0]

    @property
    def length(self) -> int:
        return self.right.shape[1]


def top_probs(logits: torch.Tensor, top_k: int = LLAMACPP_TOP_K) -> tuple[torch.Tensor, torch.Tensor]:
    """logits [N, Vd] -> (top probability over all Vd [N], top probability within the top k [N])."""
    full = torch.softmax(logits.float(), dim=-1).amax(-1)  # [N]
    top = torch.softmax(logits.float().topk(min(top_k, logits.shape[-1]), dim=-1).values, dim=-1)[:, 0]  # [N]
    return full, top


def judge_steps(drafted: torch.Tensor, text: torch.Tensor, step: int) -> torch.Tensor:
    """drafted [n] target ids step ``step`` drafts at positions 0..n-1, text [T] -> [n] bool:
    position t's token is text[t + 2 + step] (False past the text's end)."""
    n, T = drafted.shape[0], text.shape[0]
    right = torch.zeros(n, dtype=torch.bool)
    m = max(min(n, T - 2 - step), 0)
    right[:m] = drafted[:m].cpu() == text[2 + step:2 + step + m]
    return right


def draft_dtype(draft: torch.nn.Module) -> torch.dtype:
    """The precision the draft computes in (bf16 when it decodes beside a bf16 target)."""
    return next(draft.parameters()).dtype


@torch.no_grad()
def trace_text(target: Target, draft: Eagle3Draft, layout: list[int], text: list[int], prompt_len: int, *,
               steps: int, temperature: float = 0.0) -> DraftTrace:
    """Unroll ``draft`` ``steps`` times over ``text`` (prompt + an engine's output), fed the
    states of ``layout`` from ``target`` exactly as in training, and judge every step against
    the text's own next tokens (so a quantized engine's choices are what the draft must match)."""
    ids = torch.tensor([text])  # [1, T]
    T = ids.shape[1]
    aux, emb, target_probs, target_argmax = _captured(target, layout, ids, temperature, draft_dtype(draft))
    d2t = draft.draft_to_target
    right = torch.zeros(steps, T, dtype=torch.bool)
    prob = torch.zeros(steps, T)
    prob_top = torch.zeros(steps, T)
    target_prob = torch.zeros(steps, T)
    target_agrees = torch.zeros(steps, T, dtype=torch.bool)
    position_ids = torch.arange(T, device=emb.device)[None]  # [1, T]
    hidden = draft.fuse(aux.to(emb.dtype))  # [1, T, H]
    cache: list = []
    for j in range(steps):
        hidden = draft.forward_ttt(shift_left(emb, 1 + j), hidden, position_ids + j, cache)
        n = max(T - 1 - j, 0)
        logits = draft.logits(hidden[0, :n]).float()  # [n, Vd]
        drafted = d2t[logits.argmax(-1)]  # [n] target ids
        right[j, :n] = judge_steps(drafted, ids[0], j)
        prob[j, :n], prob_top[j, :n] = (x.cpu() for x in top_probs(logits))
        # the target judges step j at t with its distribution at t + 1 + j
        drafted = drafted.to(target_argmax.device)
        agrees = target_argmax[1 + j:1 + j + n] == drafted  # [n]
        target_agrees[j, :n] = agrees.cpu()
        target_prob[j, :n] = (target_probs[1 + j:1 + j + n].gather(1, drafted[:, None])[:, 0] if target_probs is not None
                              else agrees.float()).cpu()
    return DraftTrace(prompt_len=prompt_len, right=right, prob=prob, prob_top=prob_top, target_prob=target_prob,
                      target_agrees=target_agrees)


def _captured(target: Target, layout: list[int], ids: torch.Tensor, temperature: float, dtype: torch.dtype):
    """One capture of ``ids`` [1, T]: (aux [1, T, k*H] of ``layout`` and embeddings [1, T, H], both in the draft's
    ``dtype``, the target's probabilities [T, V] at the temperature (None when greedy), its argmax [T])."""
    aux_boundaries = [b for b in layout if b != target.num_layers]
    got = capture(target, ids, aux_boundaries)
    states = dict(zip(aux_boundaries, got.aux_hidden.float().split(target.hidden_size, dim=-1)))  # k x [1, T, H]
    states[target.num_layers] = got.last_hidden.float()
    aux = torch.cat([states[b] for b in layout], dim=-1).to(dtype)  # [1, T, k*H]
    emb = target.embed_tokens(ids.to(target.device)).to(dtype)  # [1, T, H]
    target_logits = target.head(got.last_hidden[0].to(target.device)).float()  # [T, V]
    # the target's probability of every token at every position, once: greedy is 1 at its argmax
    target_probs = (torch.softmax(target_logits / temperature, dim=-1) if temperature > 0 else None)  # [T, V]
    return aux, emb, target_probs, target_logits.argmax(-1)


@torch.no_grad()
def trace_blocks(target: Target, draft: DFlashDraft, layout: list[int], text: list[int], prompt_len: int, *,
                 temperature: float = 0.0, block_lens: list[int] | None = None) -> dict[int, DraftTrace]:
    """A DFlash draft along ``text``: block length -> its trace, from ONE capture of the text.

    The block anchored at every position p (context: the fused states of the tokens before p)
    drafts p+1 .. p+bs-1 in one pass; in the trace's terms it is the round whose last verified
    position is t = p - 1, and its drafted position j is step j - 1 (so ``replay`` and ``simulate``
    read it as they read the unroll). ``block_lens`` (default the trained block size): the block's
    tokens, anchor included; llama.cpp runs n_max + 1 of them, and a block's positions attend to
    each other, so a shorter block drafts other tokens.
    """
    ids = torch.tensor([text])  # [1, T]
    T = ids.shape[1]
    aux, emb, target_probs, target_argmax = _captured(target, layout, ids, temperature, draft_dtype(draft))
    lm_head, mask_emb = draft_lm_head(target, draft), mask_embedding(draft, target.embed_tokens, emb.device)
    text_ids = ids[0].to(emb.device)
    out = {}
    for bs in block_lens or [draft.config.block_size]:
        J = bs - 1
        right, prob, prob_top, target_prob = (torch.zeros(J, T, dtype=torch.bool), torch.zeros(J, T),
                                              torch.zeros(J, T), torch.zeros(J, T))
        target_agrees = torch.zeros(J, T, dtype=torch.bool)
        for start, hidden in anchored_blocks(draft, emb, mask_emb, aux, block_len=bs):
            n = hidden.shape[1]
            token, inside = drafted_index(start, n, J, T, emb.device)  # [n, J] the predicted token's index
            logits = torch.cat([lm_head(h) for h in hidden[0].reshape(n * J, -1).split(HEAD_ROWS)])  # [n*J, V]
            drafted = logits.argmax(-1).view(n, J)  # [n, J] target ids (-inf outside a pruned draft vocabulary)
            full, top = (x.view(n, J) for x in top_probs(logits))  # [n, J] each
            judged = token - 1  # [n, J] the target judges position j of anchor a at a + j - 1
            agrees = target_argmax[judged] == drafted  # [n, J]
            tp = target_probs[judged, drafted] if target_probs is not None else agrees.float()  # [n, J]
            ok = (drafted == text_ids[token]) & inside  # [n, J]
            cols = torch.arange(start - 1, start - 1 + n)  # [n] column t = anchor - 1
            first = int(start == 0)  # the block anchored at 0 has no column
            cols, sl = cols[first:], slice(first, n)
            right[:, cols] = ok[sl].T.cpu()
            prob[:, cols], prob_top[:, cols] = full[sl].T.cpu(), top[sl].T.cpu()
            target_prob[:, cols] = torch.where(inside[sl], tp[sl], torch.zeros_like(tp[sl])).T.cpu()
            target_agrees[:, cols] = (agrees[sl] & inside[sl]).T.cpu()
        out[bs] = DraftTrace(prompt_len=prompt_len, right=right, prob=prob, prob_top=prob_top, target_prob=target_prob,
                             block=True, target_agrees=target_agrees)
    return out

