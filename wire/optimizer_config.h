// SPDX-License-Identifier: Apache-2.0
// OptimizerConfigOf: the OptimizerConfig message of an optimizer's torch arguments, written
// once for the client's OptimizerOptions and the engine's HeadOptimizer (wire sees neither, so
// it is a template over their shared field names). It never resolves a default: the caller
// passes the weight decay it means.
#ifndef LOSSD_WIRE_OPTIMIZER_CONFIG_H_
#define LOSSD_WIRE_OPTIMIZER_CONFIG_H_

#include "lossd/v1/lossd.pb.h"

namespace lossd {

// `o` has lr, bias_weight_decay, momentum, dampening, nesterov, beta1, beta2, eps, amsgrad.
template <typename Options>
v1::OptimizerConfig OptimizerConfigOf(bool sgd, double weight_decay, const Options& o) {
  v1::OptimizerConfig c;
  c.set_kind(sgd ? v1::OPTIMIZER_SGD : v1::OPTIMIZER_ADAMW);
  c.set_lr(o.lr);
  c.set_weight_decay(weight_decay);
  c.set_bias_weight_decay(o.bias_weight_decay);
  if (sgd) {
    c.set_momentum(o.momentum);
    c.set_dampening(o.dampening);
    c.set_nesterov(o.nesterov);
  } else {
    // Only AdamW's own fields: an SGD config with betas would be refused on import.
    c.set_beta1(o.beta1);
    c.set_beta2(o.beta2);
    c.set_eps(o.eps);
    c.set_amsgrad(o.amsgrad);
  }
  return c;
}

}  // namespace lossd

#endif  // LOSSD_WIRE_OPTIMIZER_CONFIG_H_
