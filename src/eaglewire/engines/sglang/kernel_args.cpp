// eaglewire: the argument lists sglang 0.5.23's intel_amx attention backend calls SGLang's CPU attention kernels
// with, over the kernels of the pinned source (sgl-kernel 0.4.5, commit 3b3810d), which predate three of them.
//
// 0.5.23 passes the KV cache's dequantisation scales (key_scale, value_scale: 1.0 for an unquantised cache) and,
// to extend, whether attention is causal (false only for cross-attention and encoder-only layers). The pinned
// kernels compute unscaled, causal attention, which is exactly a text decoder's with a bf16/fp32 cache; anything
// else is refused here with what to do, never computed wrongly.
//
// Compiled beside the pinned sources; kernels.py points the two schemas in torch_extension_cpu.cpp at these.

#include <ATen/ATen.h>
#include <c10/util/Exception.h>

#include <optional>

void decode_attention_cpu(
    at::Tensor& query, at::Tensor& k_cache, at::Tensor& v_cache, at::Tensor& output,
    const std::optional<at::Tensor>& key, const std::optional<at::Tensor>& value, at::Tensor& loc,
    at::Tensor& attn_logits, at::Tensor& req_to_token, at::Tensor& req_pool_indices, at::Tensor& seq_lens,
    double sm_scale, double logit_cap, bool is_cross_attn, int64_t slidling_window_size,
    std::optional<at::Tensor> encoder_lens, std::optional<at::Tensor> sinks);

void extend_attention_cpu(
    at::Tensor& q_extend, const std::optional<at::Tensor>& k_extend, const std::optional<at::Tensor>& v_extend,
    at::Tensor& o_extend, at::Tensor& k_buffer, at::Tensor& v_buffer, at::Tensor& req_to_token,
    at::Tensor& req_pool_indices, at::Tensor& seq_lens, at::Tensor& extend_seq_lens, at::Tensor& extend_start_loc,
    int64_t max_len_extend, double sm_scale, double logit_cap, bool is_cross_attn, int64_t sliding_window_size,
    std::optional<at::Tensor> encoder_lens, std::optional<at::Tensor> sinks, std::optional<at::Tensor> tree_mask);

namespace {

void check_unscaled(double key_scale, double value_scale) {
  TORCH_CHECK(
      key_scale == 1.0 && value_scale == 1.0,
      "eaglewire's build of SGLang's CPU kernels (pinned commit 3b3810d) has no scaled (fp8) KV cache; got key_scale ",
      key_scale, ", value_scale ", value_scale, ": launch without --kv-cache-dtype fp8 (the default cache is unscaled)");
}

}  // namespace

void decode_attention_cpu_v0523(
    at::Tensor& query, at::Tensor& k_cache, at::Tensor& v_cache, double key_scale, double value_scale,
    at::Tensor& output, const std::optional<at::Tensor>& key, const std::optional<at::Tensor>& value,
    at::Tensor& loc, at::Tensor& attn_logits, at::Tensor& req_to_token, at::Tensor& req_pool_indices,
    at::Tensor& seq_lens, double sm_scale, double logit_cap, bool is_cross_attn, int64_t sliding_window_size,
    std::optional<at::Tensor> encoder_lens, std::optional<at::Tensor> sinks) {
  check_unscaled(key_scale, value_scale);
  decode_attention_cpu(query, k_cache, v_cache, output, key, value, loc, attn_logits, req_to_token,
                       req_pool_indices, seq_lens, sm_scale, logit_cap, is_cross_attn, sliding_window_size,
                       encoder_lens, sinks);
}

void extend_attention_cpu_v0523(
    at::Tensor& q_extend, const std::optional<at::Tensor>& k_extend, const std::optional<at::Tensor>& v_extend,
    at::Tensor& o_extend, at::Tensor& k_buffer, at::Tensor& v_buffer, double key_scale, double value_scale,
    at::Tensor& req_to_token, at::Tensor& req_pool_indices, at::Tensor& seq_lens, at::Tensor& extend_seq_lens,
    at::Tensor& extend_start_loc, int64_t max_len_extend, double sm_scale, double logit_cap, bool is_cross_attn,
    int64_t sliding_window_size, std::optional<at::Tensor> encoder_lens, std::optional<at::Tensor> sinks,
    std::optional<at::Tensor> tree_mask, bool is_causal) {
  check_unscaled(key_scale, value_scale);
  TORCH_CHECK(is_causal, "eaglewire's build of SGLang's CPU kernels (pinned commit 3b3810d) computes causal attention "
              "only: this model has encoder-only or cross-attention layers, which it cannot serve");
  extend_attention_cpu(q_extend, k_extend, v_extend, o_extend, k_buffer, v_buffer, req_to_token, req_pool_indices,
                       seq_lens, extend_seq_lens, extend_start_loc, max_len_extend, sm_scale, logit_cap, is_cross_attn,
                       sliding_window_size, encoder_lens, sinks, tree_mask);
}

at::Tensor fused_experts_cpu(
    at::Tensor& hidden_states, at::Tensor& w1, at::Tensor& w2, at::Tensor& topk_weights, at::Tensor& topk_ids,
    bool inplace, int64_t moe_comp_method, const std::optional<at::Tensor>& w1_scale,
    const std::optional<at::Tensor>& w2_scale, const std::optional<at::Tensor>& w1_zero,
    const std::optional<at::Tensor>& w2_zero, const std::optional<std::vector<int64_t>> block_size,
    const std::optional<at::Tensor>& w1_bias, const std::optional<at::Tensor>& w2_bias,
    const std::optional<double>& alpha, const std::optional<double>& limit, bool is_vnni);

// 0.5.23 names the experts' activation last (MoeRunnerConfig.activation, "silu" by default); the pinned kernels
// compute SiLU-and-mul (with alpha/limit for the clamped SwiGLU variant), so any other activation is refused.
at::Tensor fused_experts_cpu_v0523(
    at::Tensor& hidden_states, at::Tensor& w1, at::Tensor& w2, at::Tensor& topk_weights, at::Tensor& topk_ids,
    bool inplace, int64_t moe_comp_method, const std::optional<at::Tensor>& w1_scale,
    const std::optional<at::Tensor>& w2_scale, const std::optional<at::Tensor>& w1_zero,
    const std::optional<at::Tensor>& w2_zero, const std::optional<std::vector<int64_t>> block_size,
    const std::optional<at::Tensor>& w1_bias, const std::optional<at::Tensor>& w2_bias,
    const std::optional<double>& alpha, const std::optional<double>& limit, bool is_vnni,
    c10::string_view activation) {
  TORCH_CHECK(activation == "silu", "eaglewire's build of SGLang's CPU kernels (pinned commit 3b3810d) computes the "
              "experts with SiLU only; this model's MoE activation is ", activation);
  return fused_experts_cpu(hidden_states, w1, w2, topk_weights, topk_ids, inplace, moe_comp_method, w1_scale, w2_scale,
                           w1_zero, w2_zero, block_size, w1_bias, w2_bias, alpha, limit, is_vnni);
}
