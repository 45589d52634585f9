"""prepare --capture sglang, without SGLang: its capture ids and flags, the prompt's rows of an answer, the two
servers' URLs, and a label state answered after the final norm: checked against ours normed, stored so that the
target's head on it gives the engine's logits, and a post-norm state of another layer stopped, named."""

from __future__ import annotations

import pytest
import torch

from eaglewire.core.contract import HiddenStateContract
from eaglewire.data.engine_capture import POST_NORM, EngineCaptureError, normed, states_here
from eaglewire.data.prepare import engine_batch
from eaglewire.engines.interface import CaptureSettings
from eaglewire.engines.sglang import capture as scap
from eaglewire.engines.sglang.installation import SglangError
from test_engine_capture import TOKENS, _seqs
from tiny import tiny_target

LLAMA = "LlamaForCausalLM"


@pytest.fixture(scope="module")
def target():
    return tiny_target("llama", num_layers=6)


class PostNormEngine:
    """An engine that hands the aux boundaries as they are and the label slot after the final norm (SGLang's
    second server), that slot from boundary ``label_from``."""

    last_state = POST_NORM

    def __init__(self, target, slots, label_from=None):
        self.target, self.boundaries, self.version = target, slots, "sglang 0.5.23"
        self.label_from = target.num_layers if label_from is None else label_from

    def states(self, ids):
        here = states_here(self.target, ids)
        aux = [here[b] for b in self.boundaries[:-1]]
        return torch.stack(aux + [normed(self.target, here[self.label_from])], dim=1)  # [T, n, H]


def test_a_post_norm_label_state_is_checked_normed_and_stored_for_the_head(target):
    L = target.num_layers
    contract = HiddenStateContract(aux_boundaries=(1, 3), target=target.fingerprint)
    checked = {}
    out = list(engine_batch(PostNormEngine(target, [1, 3, L]), target, contract, _seqs(5), checked))
    assert checked[-1] == 4 and max(checked[b] for b in (1, 3, L)) < 1e-5
    seq, aux, last = out[4]
    here = states_here(target, list(seq.input_ids))
    assert torch.equal(aux, torch.cat([here[1], here[3]], dim=-1))
    with torch.no_grad():  # the head on what is stored gives the engine's (= our) logits
        logits = target.head(last[None])[0]
        ours = target.head(here[L][None])[0]
    assert torch.allclose(logits, ours, rtol=1e-4, atol=1e-4)


def test_a_post_norm_label_state_of_another_layer_is_named(target):
    L = target.num_layers
    contract = HiddenStateContract(aux_boundaries=(1, 3), target=target.fingerprint)
    with pytest.raises(EngineCaptureError) as e:
        list(engine_batch(PostNormEngine(target, [1, 3, L], label_from=L - 1), target, contract, _seqs(1), {}))
    said = str(e.value)
    assert f"boundary {L} (the label state, after the final norm, as it returns it) is boundary {L - 1} here" in said


def test_capture_ids_leave_the_label_state_to_its_server_and_refuse_the_embedding():
    assert scap.capture_ids([2, 15, 27, 30], 30, LLAMA) == [1, 14, 26]  # Llama's id b-1
    with pytest.raises(SglangError, match="no negative id"):
        scap.capture_ids([0, 15], 30, LLAMA)
    assert scap.capture_flags([1, 14]) == ["--enable-return-aux-hidden-states", "--speculative-algorithm", "EAGLE3",
                                           "--return-aux-hidden-state-layer-ids", "1", "14"]


def test_prompt_rows_of_an_answer():
    meta = {"hidden_states": [[[1.0, 2.0], [3.0, 4.0]], [[5.0, 6.0]], [7.0, 8.0]]}  # two prefill chunks, a decode row
    assert scap.prompt_rows(meta, 3, 2, who="s").tolist() == [[1, 2], [3, 4], [5, 6]]
    with pytest.raises(SglangError, match="not 4 rows of 2"):
        scap.prompt_rows({"hidden_states": [[[1.0, 2.0]]]}, 4, 2, who="s")
    with pytest.raises(SglangError, match="no hidden_states"):
        scap.prompt_rows({}, 1, 2, who="s")
    assert scap.request_body([4, 5])["return_hidden_states"] is True


def test_two_urls_and_the_dtype_it_computes_in():
    assert scap.split_urls("http://a:1, http://b:2") == ("http://a:1", "http://b:2")
    with pytest.raises(SglangError, match="AUX_URL,LABEL_URL"):
        scap.split_urls("http://a:1")
    with pytest.raises(SglangError, match="--dtype bfloat16"):
        scap.CAPTURER._plan([2, 4], 6, LLAMA, CaptureSettings(dtype="float32"))
    ids, slots = scap.CAPTURER._plan([2, 4], 6, LLAMA, CaptureSettings(dtype="bfloat16"))
    assert ids == [1, 3] and slots == [2, 4, 6]
