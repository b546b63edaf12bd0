// tpnorm/fused.h — fused residual add + hidden-sharded LayerNorm / RMSNorm (Pre-LN, Post-LN,
// DeepNorm), forward and backward.
//
// Layout and sharding as tpnorm/norm.h: x, f, h, y are [rows, hidden_local], rows agree across
// ranks, hidden_local may differ and may be 0. With Norm = LayerNorm or RMSNorm of norm.h:
//
//   forward:   h = alpha * x + f           (the new residual stream, stored in x's dtype)
//              y = Norm(h)                 (gamma, beta, mean, rstd as in norm.h)
//   backward:  dh = Norm_backward(dy; h) + dh_extra
//              dx = alpha * dh             df = dh
//              dgamma, dbeta as in norm.h: sums over this rank's rows
//
// alpha = 1 gives Pre-LN's residual add followed by the next block's norm, or Post-LN's
// Norm(x + f(x)); DeepNorm (Norm(alpha * x + f(x))) takes alpha from deepnorm_alpha().
// dh_extra is the gradient reaching h from elsewhere (in Pre-LN, h also feeds the next residual
// add, so its gradient arrives there); absent means 0.
//
// "Fused": the forward partial writes each row of h and reduces its statistics while the row is
// in cache (no separate pass over x + f); the apply phase then reads h once, as norm.h's does.
// The backward runs norm.h's two phases on (dy, h) and adds the residual epilogue (dh_extra,
// alpha) in one more element-wise pass over df.
//
// Collectives and payload per rank per call: exactly ONE all_reduce_sum, the same as the plain
// norm of norm.h (LayerNorm 2*rows + H, RMSNorm rows + H values of the wire type; H = 10 with
// agreement, 2 without). Ranks must agree on rows, dtype, eps, alpha, stats mode, the presence
// of gamma / beta / dh_extra.
//
// dtypes: x, f, h, y, dy, dh_extra, dx, df share one storage dtype (fp32, fp16, bf16, or fp64 as in
// tpnorm/norm.h); gamma,
// beta, dgamma, dbeta have it too, or float32 (mixed precision, as in tpnorm/norm.h); mean /
// rstd float32 or float64 [rows]. h may alias x or f (an in-place
// residual update). Errors: tpnorm::Error on every rank together; h is written before the
// collective, so a call that fails on ANOTHER rank leaves h = alpha*x + f written (y, mean and
// rstd untouched); a call that fails locally writes nothing.
#pragma once

#include <cstdint>

#include "tpnorm/communicator.h"
#include "tpnorm/error.h"
#include "tpnorm/norm.h"
#include "tpnorm/tensor.h"

namespace tpnorm {

/// Where a DeepNorm residual sits: the four presets of DeepNet (Wang et al., "DeepNet: Scaling
/// Transformers to 1,000 Layers", 2022, arXiv:2203.00555, table 1; the same constants as its
/// authors' reference code, torchscale). N = encoder layers, M = decoder layers.
enum class DeepNormStack : int32_t {
  kEncoderOnly = 0,              ///< encoder-only model (BERT-like):  alpha = (2N)^(1/4)
  kDecoderOnly = 1,              ///< decoder-only model (GPT-like):   alpha = (2M)^(1/4)
  kEncoderOfEncoderDecoder = 2,  ///< encoder of an encoder-decoder: alpha = 0.81 (N^4 M)^(1/16)
  kDecoderOfEncoderDecoder = 3,  ///< decoder of an encoder-decoder: alpha = (3M)^(1/4)
};

/// DeepNorm's residual scale alpha of Norm(alpha * x + f(x)) for the preset `stack` (formulas
/// above). [in] encoder_layers N, decoder_layers M: the preset's counts must be >= 1 (N for the
/// encoder-only preset, M for the decoder-only one, both for an encoder-decoder); a count the
/// preset does not use is ignored. Throws tpnorm::Error(kInvalidArgument) otherwise.
double deepnorm_alpha(DeepNormStack stack, int64_t encoder_layers, int64_t decoder_layers);

/// DeepNorm's initialisation gain beta for the same presets, by which the model scales the
/// Xavier-initialised weights of the feed-forward, value and output projections (not query and
/// key): encoder-only (8N)^(-1/4); decoder-only (8M)^(-1/4); encoder of an encoder-decoder
/// 0.87 (N^4 M)^(-1/16); its decoder (12M)^(-1/4). Arguments and errors as deepnorm_alpha.
double deepnorm_beta(DeepNormStack stack, int64_t encoder_layers, int64_t decoder_layers);

/// h = alpha*x + f; y = LayerNorm(h).
/// [in]  x, f          [rows, hidden_local]
/// [in]  alpha         finite
/// [in]  gamma, beta   [hidden_local] or absent
/// [out] h, y          [rows, hidden_local] (h may alias x or f)
/// [out] mean, rstd    [rows] float32/float64, or absent (inference)
void fused_add_layer_norm_forward(Communicator& comm, const TensorView& x, const TensorView& f,
                                  double alpha, const TensorView& gamma, const TensorView& beta,
                                  const TensorView& h, const TensorView& y, const TensorView& mean,
                                  const TensorView& rstd, const NormOptions& opt = {});

/// Backward of fused_add_layer_norm_forward.
/// [in]  dy, h         [rows, hidden_local] (h as written by the forward)
/// [in]  dh_extra      [rows, hidden_local] or absent (= 0)
/// [in]  gamma         [hidden_local] or absent;  mean, rstd [rows] from the forward
/// [in]  alpha         as in the forward
/// [out] dx, df        [rows, hidden_local], two distinct buffers
/// [out] dgamma, dbeta [hidden_local] or absent: sums over this rank's rows (overwritten)
void fused_add_layer_norm_backward(Communicator& comm, const TensorView& dy,
                                   const TensorView& dh_extra, const TensorView& h,
                                   const TensorView& gamma, const TensorView& mean,
                                   const TensorView& rstd, double alpha, const TensorView& dx,
                                   const TensorView& df, const TensorView& dgamma,
                                   const TensorView& dbeta, const NormOptions& opt = {});

/// h = alpha*x + f; y = RMSNorm(h). Arguments as fused_add_layer_norm_forward without beta
/// and mean.
void fused_add_rms_norm_forward(Communicator& comm, const TensorView& x, const TensorView& f,
                                double alpha, const TensorView& gamma, const TensorView& h,
                                const TensorView& y, const TensorView& rstd,
                                const NormOptions& opt = {});

/// Backward of fused_add_rms_norm_forward. Arguments as fused_add_layer_norm_backward without
/// mean and dbeta.
void fused_add_rms_norm_backward(Communicator& comm, const TensorView& dy,
                                 const TensorView& dh_extra, const TensorView& h,
                                 const TensorView& gamma, const TensorView& rstd, double alpha,
                                 const TensorView& dx, const TensorView& df,
                                 const TensorView& dgamma, const NormOptions& opt = {});

}  // namespace tpnorm
