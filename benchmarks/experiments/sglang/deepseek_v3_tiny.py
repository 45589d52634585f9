"""Does SGLang 0.5.23's CPU path serve a tiny random DeepSeek-V3 target, plainly and with EAGLE-3?

Builds (seconds) a tiny random DeepSeek-V3 target (MLA, MoE, first_k_dense_replace=1; SmolLM2's
tokenizer), serves it plainly with SGLang on CPU, then with random EAGLE-3 drafts in SGLang's
format (LlamaForCausalLMEagle3) whose config ids are the ones seeds would write, and reports
greedy outputs, spec_verify_ct, accept histograms, errors, and the `layers_to_capture` that
SGLang's own `DeepseekV2ForCausalLM.set_eagle3_layers_to_capture` sets for each id list (called
unbound on a stand-in object, so the real source runs; nothing under the SGLang venv is edited).

    .venv/bin/python benchmarks/experiments/sglang/deepseek_v3_tiny.py [--work DIR] [--out results.json]
        [--only plain,m1_2_4,1_3_4,...]

Env: SGLANG_PYTHON (default eaglewire's install, `make sglang`), SGL_PORT (default 30817).
"""
from __future__ import annotations

import argparse
import json
import os
import shutil
import signal
import subprocess
import sys
import time
import urllib.error
import urllib.request
from pathlib import Path

SGLANG_PYTHON = os.environ.get(
    "SGLANG_PYTHON", str(Path.home() / ".cache/eaglewire/engines/sglang-0.5.23/venv/bin/python"))  # `make sglang`
PORT = int(os.environ.get("SGL_PORT", "30817"))
SEED = 0
NUM_LAYERS = 6
HIDDEN = 256
VOCAB = 49152
# token ids of a short prompt under SmolLM2's tokenizer are made at run time; max_new_tokens:
MAX_NEW = 16
PROMPTS = ["The capital of France is", "def fibonacci(n):", "Once upon a time, there was a"]

# the EAGLE-3 config id lists tried: name -> ids
ID_SETS = {
    "m1_2_4": [-1, 2, 4],   # seeds' style: embedding (-1), then two layers' outputs
    "1_3_4": [1, 3, 4],     # SpecForge/llama style: outputs of layers 1, 3, 4
    "0_2_4": [0, 2, 4],     # what 0.5.23 deepseek_v2 needs for boundaries 0, 2, 4 (verbatim ids)
}


def smollm2_dir() -> Path:
    out = subprocess.run(
        [str(Path(__file__).resolve().parents[3] / ".venv/bin/python"), "-c",
         "from eaglewire.model.target import resolve_target_path; print(resolve_target_path('smollm2-135m'))"],
        check=True, capture_output=True, text=True).stdout.strip().splitlines()[-1]
    return Path(out)


# DeepSeek-V3's (and Kimi-K2's) own RoPE: YaRN, factor 40 over 4096 (Kimi-K2: factor 32). SGLang's CPU
# rope (layers/rotary_embedding/factory.py get_rope_cpu) asserts rope_scaling is not None and only
# supports deepseek_yarn, so a plain-RoPE ("default") DeepSeek-V3 does not start on CPU.
YARN = {"rope_type": "yarn", "rope_theta": 10000.0, "factor": 40.0, "original_max_position_embeddings": 4096,
        "beta_fast": 32.0, "beta_slow": 1.0, "mscale": 1.0, "mscale_all_dim": 1.0}


HF_MISSING = {"moe_layer_freq": 1, "topk_method": "noaux_tc", "scoring_func": "sigmoid", "ep_size": 1}


# MLA sizes. SGLang's CPU kernels (sgl-kernel csrc/cpu) need: extend.cpp:512-513
# TORCH_CHECK(head_size % 32 == 0, "invalid head_size ") for qk_nope+qk_rope and for v_head_dim (so the
# brief's 32+16=48 fails: "RuntimeError: invalid head_size 48"); decode.cpp takes its MLA path only when
# head_size == head_size_v + 64, i.e. qk_rope_head_dim == 64 (DeepSeek-V3's own value).
MLA = {"kv_lora_rank": 64, "qk_rope": 64, "qk_nope": 64, "v_head": 64}
MLA_SMALL = {"kv_lora_rank": 32, "qk_rope": 16, "qk_nope": 32, "v_head": 32}


# Routed experts: SGLang's CPU path packs the router weight [n_routed_experts, hidden] with
# sgl_kernel.convert_weight_packed, which for OC < 16 returns weight.to(float).t() (gemm.cpp:621-623),
# and MoEGate.forward then takes its fp32 branch F.linear(x.float(), self.weight) (deepseek_v2.py:562-563)
# with the transposed weight: "RuntimeError: mat1 and mat2 shapes cannot be multiplied (6x256 and 4x256)".
# So n_routed_experts must be >= 16 (a multiple of 16) on CPU; 4 fails.
# DeepSeek-V3 routing (topk_method noaux_tc, sigmoid, e_score_correction_bias) runs on CPU through
# sgl_kernel biased_grouped_topk_cpu (topk.cpp:674-689): TORCH_CHECK(topk == 8, "Unexpected topk: ") and
# num_experts in {128, 192, 256, 384} only ("RuntimeError: Unexpected topk: 2" with 16 experts, top-2).
# DeepSeek-V3 itself is 256/top-8, Kimi-K2 384/top-8; the tiny target uses 128/top-8.
N_EXPERTS = 128
TOP_K = 8
# MoE layers cannot run on this CPU build at all. SGLang 0.5.23 calls sgl_kernel.fused_experts_cpu
# (layers/quantization/unquant.py:1361-1379) with 18 arguments (the last: moe_runner_config.activation)
# while the CPU kernels built here (pinned sgl-kernel 0.4.5 + eaglewire's kernel_args.cpp, which adapts only
# the attention kernels) declare 17: "RuntimeError: sgl_kernel::fused_experts_cpu() expected at most 17
# argument(s) but received 18". No expert width avoids it: on CPU SGLang pads moe_intermediate_size to a
# multiple of 32 (configs/update_config.py adjust_config_with_unaligned_cpu_tp, DEFAULT_MOE_PADDING_SIZE 32),
# so the experts are always AMX-packed and always take that call (tried 44: same error).
# The nearest DeepSeek-V3 that runs: first_k_dense_replace = num_hidden_layers (every layer dense: MLA
# attention + dense MLP, the deepseek_v2.py model and its EAGLE-3 capture path; no MoE).
MOE_INTER = 64
FIRST_K_DENSE = NUM_LAYERS


def build_target(path: Path, rope: str = "yarn", extra: dict | None = HF_MISSING, mla: dict | None = None,
                 n_experts: int = N_EXPERTS, top_k: int = TOP_K, moe_inter: int = MOE_INTER,
                 first_k_dense: int = FIRST_K_DENSE) -> dict:
    import torch
    from transformers import DeepseekV3Config, DeepseekV3ForCausalLM

    t0 = time.time()
    m = mla or MLA
    kv_lora_rank, qk_rope, qk_nope, v_head = m["kv_lora_rank"], m["qk_rope"], m["qk_nope"], m["v_head"]
    path.mkdir(parents=True, exist_ok=True)
    torch.manual_seed(SEED)
    cfg = DeepseekV3Config(
        vocab_size=VOCAB, hidden_size=HIDDEN, intermediate_size=512, moe_intermediate_size=moe_inter,
        num_hidden_layers=NUM_LAYERS, num_attention_heads=4, num_key_value_heads=4,
        n_shared_experts=1, n_routed_experts=n_experts, num_experts_per_tok=top_k, routed_scaling_factor=1.0,
        kv_lora_rank=kv_lora_rank, q_lora_rank=64, qk_rope_head_dim=qk_rope, qk_nope_head_dim=qk_nope,
        v_head_dim=v_head,
        n_group=1, topk_group=1, first_k_dense_replace=first_k_dense, norm_topk_prob=True,
        max_position_embeddings=163840 if rope == "yarn" else 4096, rms_norm_eps=1e-6,
        rope_parameters=dict(YARN) if rope == "yarn" else {"rope_type": "default", "rope_theta": 10000.0}, tie_word_embeddings=False,
        bos_token_id=1, eos_token_id=2, pad_token_id=2,
    )
    cfg.architectures = ["DeepseekV3ForCausalLM"]
    # keys of DeepSeek-V3's / Kimi-K2's own config.json that transformers' DeepseekV3Config does not
    # define; SGLang's deepseek_v2.py reads config.moe_layer_freq unguarded (_is_layer_sparse), so
    # without it the server dies: AttributeError: 'DeepseekV3Config' object has no attribute 'moe_layer_freq'
    for k, v in (extra or {}).items():
        setattr(cfg, k, v)
    model = DeepseekV3ForCausalLM(cfg)
    with torch.no_grad():  # a random model with non-degenerate logits: N(0, 0.02) everywhere, norms 1
        for name, p in model.named_parameters():
            if "norm" in name:
                p.fill_(1.0)
            elif "e_score_correction_bias" in name:
                p.zero_()
            else:
                p.normal_(0.0, 0.02)
        for name, b in model.named_buffers():
            if "e_score_correction_bias" in name:
                b.zero_()
    model = model.to(torch.bfloat16)
    model.save_pretrained(path, safe_serialization=True)
    src = smollm2_dir()
    for f in ("tokenizer.json", "tokenizer_config.json", "chat_template.jinja", "special_tokens_map.json"):
        if (src / f).exists():
            shutil.copy(src / f, path / f)
    conf = json.loads((path / "config.json").read_text())
    return {"path": str(path), "build_s": round(time.time() - t0, 2), "model_type": conf.get("model_type"),
            "architectures": conf.get("architectures"), "num_params": sum(p.numel() for p in model.parameters()),
            "files": sorted(os.listdir(path))}


def build_draft(path: Path, layer_ids: list[int], seed: int = SEED) -> dict:
    """A random EAGLE-3 draft in SGLang's format (LlamaForCausalLMEagle3, SpecForge tensor names;
    llama_eagle3.py load_weights maps midlayer -> layers.0 and q/k/v, gate/up -> fused params)."""
    import torch
    from safetensors.torch import save_file

    path.mkdir(parents=True, exist_ok=True)
    H, heads, kv, hd, inter = HIDDEN, 4, 2, 64, 512
    config = {
        "architectures": ["LlamaForCausalLMEagle3"], "model_type": "llama",
        "hidden_size": H, "target_hidden_size": H, "intermediate_size": inter,
        "num_hidden_layers": 1, "num_attention_heads": heads, "num_key_value_heads": kv, "head_dim": hd,
        "vocab_size": VOCAB, "draft_vocab_size": VOCAB, "rms_norm_eps": 1e-6, "rope_theta": 10000.0,
        "max_position_embeddings": 163840, "hidden_act": "silu", "tie_word_embeddings": False,
        "torch_dtype": "bfloat16", "bos_token_id": 1, "eos_token_id": 2,
        "eagle_config": {"eagle_aux_hidden_state_layer_ids": list(layer_ids), "use_aux_hidden_state": True},
    }
    # max_position_embeddings as the target's: with 4096 the draft worker dies in model_config.py
    # _derive_context_length: "ValueError: ... Target model's context_length (163840) is greater than the
    # derived context_length (4096) ..."
    (path / "config.json").write_text(json.dumps(config, indent=2))
    g = torch.Generator().manual_seed(seed)

    def rnd(*shape):
        return (torch.randn(*shape, generator=g) * 0.02).to(torch.bfloat16)

    ones = lambda n: torch.ones(n, dtype=torch.bfloat16)  # noqa: E731
    t = {
        "fc.weight": rnd(H, 3 * H),
        "midlayer.input_layernorm.weight": ones(H), "midlayer.hidden_norm.weight": ones(H),
        "midlayer.post_attention_layernorm.weight": ones(H),
        "midlayer.self_attn.q_proj.weight": rnd(heads * hd, 2 * H),
        "midlayer.self_attn.k_proj.weight": rnd(kv * hd, 2 * H),
        "midlayer.self_attn.v_proj.weight": rnd(kv * hd, 2 * H),
        "midlayer.self_attn.o_proj.weight": rnd(H, heads * hd),
        "midlayer.mlp.gate_proj.weight": rnd(inter, H), "midlayer.mlp.up_proj.weight": rnd(inter, H),
        "midlayer.mlp.down_proj.weight": rnd(H, inter),
        "norm.weight": ones(H), "lm_head.weight": rnd(VOCAB, H),
    }
    save_file(t, str(path / "model.safetensors"))
    return {"path": str(path), "layer_ids": list(layer_ids)}


def sglang_layers_to_capture(cases):
    """Run SGLang's own DeepseekV2ForCausalLM.set_eagle3_layers_to_capture on a stand-in self, for
    each (layer_ids, num_hidden_layers) in ``cases`` (one subprocess) -> list of layers_to_capture."""
    code = r"""
import json, sys, types
from sglang.srt.models.deepseek_v2 import DeepseekV2ForCausalLM
out = []
for ids, n in json.loads(sys.argv[1]):
    me = types.SimpleNamespace(pp_group=types.SimpleNamespace(is_last_rank=True),
                               config=types.SimpleNamespace(num_hidden_layers=n), model=types.SimpleNamespace())
    DeepseekV2ForCausalLM.set_eagle3_layers_to_capture(me, ids)
    out.append(me.model.layers_to_capture)
print(json.dumps(out))
"""
    out = subprocess.run([SGLANG_PYTHON, "-c", code, json.dumps(cases)],
                         capture_output=True, text=True, env={**os.environ, "SGLANG_USE_CPU_ENGINE": "1"})
    if out.returncode:
        raise RuntimeError(out.stderr.strip().splitlines()[-1:])
    return json.loads(out.stdout.strip().splitlines()[-1])


def _get(url, timeout=5):
    with urllib.request.urlopen(url, timeout=timeout) as r:
        return r.status, r.read()


def _post(url, body, timeout=300):
    req = urllib.request.Request(url, data=json.dumps(body).encode(), headers={"Content-Type": "application/json"})
    try:
        with urllib.request.urlopen(req, timeout=timeout) as r:
            return r.status, json.loads(r.read())
    except urllib.error.HTTPError as e:
        return e.code, e.read().decode(errors="replace")


def serve_and_generate(target: Path, prompts_ids, log: Path, draft: Path | None = None, timeout_s: int = 420) -> dict:
    cmd = [SGLANG_PYTHON, "-m", "sglang.launch_server", "--model-path", str(target), "--device", "cpu",
           "--attention-backend", "intel_amx", "--dtype", "bfloat16", "--host", "127.0.0.1", "--port", str(PORT),
           "--random-seed", "0", "--disable-radix-cache", "--enable-metrics", "--max-total-tokens", "16384"]
    if draft is not None:
        cmd += ["--speculative-algorithm", "EAGLE3", "--speculative-draft-model-path", str(draft),
                "--speculative-num-steps", "3", "--speculative-eagle-topk", "1", "--speculative-num-draft-tokens", "4"]
    env = {**os.environ, "SGLANG_USE_CPU_ENGINE": "1", "SGLANG_CPU_KERNELS_BUILT": "1",
           "SGLANG_CPU_OMP_THREADS_BIND": "0-1", "HF_HUB_OFFLINE": "1", "OMP_NUM_THREADS": "2"}
    res: dict = {"cmd": " ".join(cmd), "log": str(log)}
    t0 = time.time()
    with open(log, "w") as lf:
        proc = subprocess.Popen(cmd, stdout=lf, stderr=subprocess.STDOUT, env=env, start_new_session=True)
    pgid = os.getpgid(proc.pid)
    try:
        ready = False
        while time.time() - t0 < timeout_s:
            if proc.poll() is not None:
                break
            try:
                if _get(f"http://127.0.0.1:{PORT}/health")[0] == 200:
                    ready = True
                    break
            except Exception:
                pass
            time.sleep(1)
        res["startup_s"] = round(time.time() - t0, 1)
        res["started"] = ready
        if not ready:
            res["exit_code"] = proc.poll()
            res["error_tail"] = _error_lines(log)
            return res
        outs = []
        for ids in prompts_ids:
            t1 = time.time()
            code, body = _post(f"http://127.0.0.1:{PORT}/generate",
                               {"input_ids": ids, "sampling_params": {"temperature": 0, "max_new_tokens": MAX_NEW}})
            item = {"http": code, "s": round(time.time() - t1, 2)}
            if code == 200:
                mi = body.get("meta_info", {})
                item.update(output_ids=body.get("output_ids"),
                            **{k: mi.get(k) for k in ("completion_tokens", "spec_verify_ct", "spec_accept_length",
                                                      "spec_correct_drafts_histogram", "spec_accept_histogram")
                               if k in mi})
            else:
                item["body"] = str(body)[-2000:]
            outs.append(item)
            if proc.poll() is not None:
                break
        res["outputs"] = outs
        res["alive_after"] = proc.poll() is None
        if not res["alive_after"] or any(o["http"] != 200 for o in outs):
            res["error_tail"] = _error_lines(log)
        return res
    finally:
        try:
            os.killpg(pgid, signal.SIGKILL)
        except ProcessLookupError:
            pass
        proc.wait()
        time.sleep(2)


def _error_lines(log: Path, n: int = 25):
    lines = log.read_text(errors="replace").splitlines()
    idx = [i for i, l in enumerate(lines) if "Traceback" in l]
    if idx:
        return lines[idx[0]:][-60:]
    return lines[-n:]


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--work", default="/tmp/dsv3-tiny")
    ap.add_argument("--out", default=None)
    ap.add_argument("--rope", choices=["yarn", "default"], default="yarn",
                    help="target RoPE: DeepSeek-V3's yarn (default) or plain (fails on SGLang's CPU path)")
    ap.add_argument("--hf-config-only", action="store_true",
                    help="no DeepSeek-V3 config keys beyond transformers' (fails: moe_layer_freq)")
    ap.add_argument("--small-mla", action="store_true",
                    help="MLA ranks 32/16/32/32 (fails on CPU: invalid head_size 48)")
    ap.add_argument("--experts", type=int, default=N_EXPERTS, help="n_routed_experts (CPU: 128/192/256/384)")
    ap.add_argument("--top-k", type=int, default=TOP_K, help="num_experts_per_tok (CPU: 8 only)")
    ap.add_argument("--moe-inter", type=int, default=MOE_INTER,
                    help="moe_intermediate_size")
    ap.add_argument("--first-k-dense", type=int, default=FIRST_K_DENSE,
                    help="first_k_dense_replace (default all layers dense; < layers = MoE layers, which fail here)")
    ap.add_argument("--only", default=None, help="comma list of: plain and ID_SETS names")
    a = ap.parse_args()
    work = Path(a.work)
    work.mkdir(parents=True, exist_ok=True)
    only = set(a.only.split(",")) if a.only else None
    report: dict = {"target": build_target(work / "target", a.rope, None if a.hf_config_only else HF_MISSING,
                                            MLA_SMALL if a.small_mla else MLA, a.experts, a.top_k, a.moe_inter, a.first_k_dense)}
    from transformers import AutoTokenizer
    tok = AutoTokenizer.from_pretrained(work / "target")
    prompts_ids = [tok(p)["input_ids"] for p in PROMPTS]
    report["prompts_ids"] = prompts_ids
    kimi = [[-1, 2, 30], [0, 3, 31], [1, 3, 31], [-1, 3, 31], [2, 30, 58]]
    got = sglang_layers_to_capture([[ids, NUM_LAYERS] for ids in ID_SETS.values()] + [[ids, 61] for ids in kimi])
    report["layers_to_capture"] = {name: {"ids": ids, "layers_to_capture": lc}
                                   for (name, ids), lc in zip(ID_SETS.items(), got)}
    report["layers_to_capture_kimi61"] = {str(ids): lc for ids, lc in zip(kimi, got[len(ID_SETS):])}
    print(json.dumps({k: report[k] for k in ("target", "layers_to_capture", "layers_to_capture_kimi61")}, indent=1),
          flush=True)
    runs = {}
    if only is None or "plain" in only:
        runs["plain"] = serve_and_generate(work / "target", prompts_ids, work / "plain.log")
        print("plain", json.dumps(runs["plain"])[:3000], flush=True)
    for name, ids in ID_SETS.items():
        if only is not None and name not in only:
            continue
        d = build_draft(work / f"draft_{name}", ids)
        runs[name] = serve_and_generate(work / "target", prompts_ids, work / f"eagle3_{name}.log", draft=Path(d["path"]))
        runs[name]["layer_ids"] = ids
        plain = runs.get("plain", {}).get("outputs")
        if plain and runs[name].get("outputs"):
            runs[name]["equal_to_plain"] = [p.get("output_ids") == s.get("output_ids")
                                            for p, s in zip(plain, runs[name]["outputs"])]
        print(name, json.dumps(runs[name])[:3000], flush=True)
    report["runs"] = runs
    out = Path(a.out) if a.out else work / "results.json"
    out.write_text(json.dumps(report, indent=1))
    print("wrote", out)


if __name__ == "__main__":
    sys.exit(main())
