// reference_bwd.h - the backward pass of attention in float64 on the CPU, straight from the
// definition, for checking a stage's dQ, dK, dV; and, on request, the error a correct fp16 kernel
// can make on each element (in units of u, as reference_error in reference.h).
//
// With s_ij = scale q_i.k_j (j <= i when causal), P = softmax over j, O = P V and dO given:
//   dV_j = sum_i P_ij dO_i                     dP_ij = dO_i . v_j
//   δ_i  = sum_j P_ij dP_ij  (= dO_i . O_i)      dS_ij = P_ij (dP_ij - δ_i)
//   dQ_i = scale sum_j dS_ij k_j                dK_j = scale sum_i dS_ij q_i
// A row of dQ needs only row i; a row of dK or dV needs column j of P, so every row's normalizer:
// the per-head statistics below are computed first (3 S^2 D multiply-adds per head).
#ifndef FLASH_STAGES_REFERENCE_BWD_H
#define FLASH_STAGES_REFERENCE_BWD_H

#include "attn.h"
#include "reference.h"

// For query head (b, h): lse[i] = log sum_j exp(s_ij) and delta[i] = δ_i, for every row i (S
// each). delta_err (S doubles each, or both NULL): the error of a kernel's δ_i, which it computes
// from its own O. q and d_o are [B, H, S, D], k and v [B, H_kv, S_kv, D] float copies of the
// tensors; query head h reads K/V head h / (H / H_kv), and with the mask query i sees keys
// 0..i + S_kv - S.
void reference_bwd_stats(const attn_shape *shape, const float *q, const float *k, const float *v,
                         const float *d_o, int b, int h, double *lse, double *delta,
                         reference_error delta_err);

// dQ[b, h, i, :] (D doubles) from the head's statistics, and its error magnitudes when dq_err is
// set (then delta_err must be too).
void reference_dq_row(const attn_shape *shape, const float *q, const float *k, const float *v,
                      const float *d_o, int b, int h, const double *lse, const double *delta,
                      reference_error delta_err, int i, double *dq_row, reference_error dq_err);

// dK[b, kv_h, j, :] and dV[b, kv_h, j, :] (D doubles each), summed over the H / H_kv query heads
// that read K/V head kv_h, from their statistics: lse, delta and delta_err hold [H / H_kv][S],
// query head kv_h (H / H_kv) + g at g S. Their error magnitudes too when dk_err and dv_err are set
// (then delta_err must be too).
void reference_dkdv_row(const attn_shape *shape, const float *q, const float *k, const float *v,
                        const float *d_o, int b, int h, const double *lse, const double *delta,
                        reference_error delta_err, int j, double *dk_row, double *dv_row,
                        reference_error dk_err, reference_error dv_err);

#endif
