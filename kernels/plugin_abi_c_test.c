/* plugin_abi.h is C: this file is compiled by the C compiler (c99, pedantic, warnings as
 * errors), and checks the constants a plugin and a server must agree on. */
#include "kernels/plugin_abi.h"

#include <stddef.h>
#include <stdio.h>
#include <string.h>

static int Check(int ok, const char* what) {
  if (!ok) fprintf(stderr, "FAILED: %s\n", what);
  return ok ? 0 : 1;
}

int main(void) {
  LossdBackendApi api;
  LossdStatus status;
  int failures = 0;
  memset(&api, 0, sizeof(api));
  memset(&status, 0, sizeof(status));
  failures += Check(LOSSD_PLUGIN_ABI_MAJOR == 6u && LOSSD_PLUGIN_ABI_CURRENT_MINOR == 6u,
                    "the ABI version is 6.6");
  failures += Check(LOSSD_PLUGIN_ABI_VERSION == 0x60006u, "major.minor packed as major << 16");
  /* 6.6: cispo_clamp after vespo. */
  failures += Check(LOSSD_POLICY_CISPO_CLAMP == LOSSD_POLICY_VESPO + 1,
                    "cispo_clamp follows vespo");
  /* 6.5: vespo after kl_cov, its gamma parameters after 6.4's fields. */
  failures += Check(LOSSD_POLICY_VESPO == LOSSD_POLICY_KL_COV + 1, "vespo follows kl_cov");
  failures += Check(offsetof(LossdProblem, vespo_k_pos) > offsetof(LossdProblem, ppo_kl_coef)
                        && offsetof(LossdProblem, vespo_lambda_neg)
                               > offsetof(LossdProblem, vespo_k_neg),
                    "6.5's vespo options at the end of LossdProblem");
  /* 6.4: geo_mean and kl_cov after gpg, kl_cov's options at the end of LossdProblem. */
  failures += Check(LOSSD_POLICY_GEO_MEAN == LOSSD_POLICY_GPG + 1
                        && LOSSD_POLICY_KL_COV == LOSSD_POLICY_GEO_MEAN + 1,
                    "geo_mean and kl_cov follow gpg");
  failures += Check(offsetof(LossdProblem, kl_cov_ratio)
                        > offsetof(LossdProblem, distill_weight_soft_loss)
                        && offsetof(LossdProblem, ppo_kl_coef) > offsetof(LossdProblem, kl_cov_ratio),
                    "6.4's kl_cov options at the end of LossdProblem");
  /* 6.3's fields come after every field of 6.2. */
  failures += Check(offsetof(LossdProblem, is_ratio) > offsetof(LossdProblem, distill)
                        && offsetof(LossdProblem, loss_scale_factor)
                               > offsetof(LossdProblem, aggregation),
                    "6.3's policy options at the end of LossdProblem");
  /* 6.1's field comes after every field of 6.0. */
  failures += Check(offsetof(LossdBackendInfo, compute_path)
                        > offsetof(LossdBackendInfo, loss_kinds),
                    "6.1's compute_path at the end of LossdBackendInfo");
  failures += Check(LOSSD_PLUGIN_ABI_MAJOR_OF(0x60002u) == 6u
                        && LOSSD_PLUGIN_ABI_MINOR_OF(0x60002u) == 2u
                        && LOSSD_PLUGIN_ABI_MAJOR_OF(5u) == 5u && LOSSD_PLUGIN_ABI_MINOR_OF(5u) == 0u,
                    "a version's major and minor; a number from before major.minor is a major");
  failures += Check(strcmp(LOSSD_PLUGIN_ENTRY_SYMBOL, "LossdPluginGetApi") == 0,
                    "the entry point's name");
  failures += Check(strcmp(LOSSD_CUDA_NO_GPU_PREFIX, "no GPU: ") == 0, "the no-GPU prefix");
  /* The version fields come first in every version, so any table can say what it is. */
  failures += Check((const void*)&api.struct_size == (const void*)&api, "struct_size first");
  failures += Check(sizeof(api.struct_size) == 4 && sizeof(api.abi_version) == 4,
                    "32-bit version fields");
  failures += Check(api.create == NULL && status.code == 0, "plain data");
  /* Version 3's functions come after every function of version 2, and 6.2's after them, in
   * the order a plugin fills them, at the end of the table. */
  failures += Check(offsetof(LossdBackendApi, optimizer_step) > offsetof(LossdBackendApi, host_free)
                        && offsetof(LossdBackendApi, sum_of_squares) + sizeof(api.sum_of_squares)
                               == offsetof(LossdBackendApi, comm_available),
                    "version 3's functions after version 2's, before 6.2's");
  failures += Check(offsetof(LossdBackendApi, comm_new_id) > offsetof(LossdBackendApi, comm_available)
                        && offsetof(LossdBackendApi, comm_connect)
                               > offsetof(LossdBackendApi, comm_new_id)
                        && offsetof(LossdBackendApi, comm_reduce_scatter)
                               > offsetof(LossdBackendApi, comm_connect)
                        && offsetof(LossdBackendApi, comm_all_gather)
                               > offsetof(LossdBackendApi, comm_reduce_scatter)
                        && offsetof(LossdBackendApi, comm_abort)
                               > offsetof(LossdBackendApi, comm_all_gather)
                        && offsetof(LossdBackendApi, comm_destroy) + sizeof(api.comm_destroy)
                               == sizeof(LossdBackendApi),
                    "6.2's comm functions at the end of the table, in order");
  failures += Check(LOSSD_COMM_ID_BYTES == 128, "a communicator id is NCCL's 128 bytes");
  failures += Check(LOSSD_OPTIMIZER_SGD == 0 && LOSSD_OPTIMIZER_ADAMW == 1, "optimizer kinds");
  /* lossd::LossKind's and PolicyLossType's values. */
  failures += Check(LOSSD_LOSS_CROSS_ENTROPY == 0 && LOSSD_LOSS_LOGPROB == 1
                        && LOSSD_LOSS_POLICY == 2 && LOSSD_LOSS_DISTILL == 3,
                    "loss kinds");
  failures += Check(LOSSD_POLICY_DAPO == 0 && LOSSD_POLICY_GRPO == 1 && LOSSD_POLICY_BNPO == 2
                        && LOSSD_POLICY_DR_GRPO == 3 && LOSSD_POLICY_CISPO == 4
                        && LOSSD_POLICY_SAPO == 5 && LOSSD_POLICY_LUSPO == 6,
                    "policy loss types");
  if (failures == 0) printf("plugin_abi.h compiles as C\n");
  return failures == 0 ? 0 : 1;
}
