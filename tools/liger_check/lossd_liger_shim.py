# SPDX-License-Identifier: Apache-2.0
"""A pytest plugin that runs Liger-Kernel's own fused linear cross-entropy tests against lossd.

Loaded with `-p lossd_liger_shim` (run.sh beside this file does it), before pytest imports the
test file: it starts a lossd server on loopback and makes the three names that test file uses,
liger_kernel.ops.LigerFusedLinearCrossEntropyFunction,
liger_kernel.transformers.functional.liger_fused_linear_cross_entropy and
liger_kernel.transformers.fused_linear_cross_entropy.LigerFusedLinearCrossEntropyLoss, resolve
to lossd.nn's. It never edits Liger's files: the tests run as Liger ships them.

Env: LOSSD_BIN (the lossd binary; required), LOSSD_LIGER_BACKEND (the server's --backend,
default cpu; cuda on a GPU host).
"""

import os
import signal
import socket
import subprocess
import tempfile
import time

import torch

import lossd
from lossd import nn as lossd_nn

_state = {}


def _free_port():
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _start_server():
    binary = os.environ["LOSSD_BIN"]
    port = _free_port()
    log = tempfile.NamedTemporaryFile(prefix="lossd_liger_", suffix=".log", delete=False)
    backend = os.environ.get("LOSSD_LIGER_BACKEND", "cpu")
    proc = subprocess.Popen([binary, "--port=%d" % port, "--backend=%s" % backend,
                             "--metrics_port=0", "--drain_seconds=2"],
                            stdout=log, stderr=subprocess.STDOUT)
    address = "127.0.0.1:%d" % port
    client = lossd.Client(address)
    deadline = time.monotonic() + 60
    while True:
        if proc.poll() is not None:
            raise RuntimeError("lossd exited with %s at start; log: %s" % (proc.returncode,
                                                                            log.name))
        try:
            if client.health() == "SERVING":
                break
        except lossd.LossdError:
            pass
        if time.monotonic() > deadline:
            proc.kill()
            raise RuntimeError("lossd not SERVING after 60 s; log: %s" % log.name)
        time.sleep(0.1)
    _state.update(proc=proc, client=client, log=log)


def _runtime():
    # Weights go inline: each test makes new ones, and a handle per module would only fill
    # the server's cache.
    return lossd_nn.LossdRuntime(client=_state["client"], cache_weights=False)


def _as_liger_output(result, liger_output_cls):
    if isinstance(result, lossd_nn.CrossEntropyOutput):
        return liger_output_cls(loss=result.loss, z_loss=result.z_loss,
                                token_accuracy=result.token_accuracy,
                                predicted_tokens=result.predicted_tokens)
    return result


def _install(liger_ops, liger_functional, liger_flce):
    liger_output_cls = liger_functional.CrossEntropyOutput

    class LossdLigerFunction:
        """Liger's autograd Function's apply signature (its inner-implementation and chunking
        arguments accepted and left to the server), computed by lossd."""

        @staticmethod
        def apply(_input, weight, target, bias=None, ce_weight=None, ignore_index=-100,
                  lse_square_scale=0.0, label_smoothing=0.0, reduction="mean", softcap=None,
                  return_z_loss=False, accum_dtype=None, use_token_scaling=False,
                  return_token_accuracy=False, return_predicted_tokens=False, ce_impl=None,
                  ce_mode=None, chunk_mem_const=None):
            return lossd_nn.LossdFusedLinearCrossEntropyFunction.apply(
                _input, weight, target, bias, ce_weight, ignore_index, lse_square_scale,
                label_smoothing, reduction, softcap, return_z_loss, accum_dtype,
                use_token_scaling, return_token_accuracy, return_predicted_tokens, None,
                _runtime(), torch.is_grad_enabled())

    def liger_fused_linear_cross_entropy(input, weight, target, bias=None, ce_weight=None,
                                         ignore_index=-100, lse_square_scale=0.0,
                                         label_smoothing=0.0, reduction="mean", softcap=None,
                                         return_z_loss=False, accum_dtype=None,
                                         use_token_scaling=False, return_token_accuracy=False,
                                         return_predicted_tokens=False, chunk_mem_const=1):
        return _as_liger_output(lossd_nn.lossd_fused_linear_cross_entropy(
            input, weight, target, bias, ce_weight, ignore_index, lse_square_scale,
            label_smoothing, reduction, softcap, return_z_loss, accum_dtype,
            use_token_scaling, return_token_accuracy, return_predicted_tokens,
            runtime=_runtime()), liger_output_cls)

    class LigerFusedLinearCrossEntropyLoss(lossd_nn.LossdFusedLinearCrossEntropyLoss):
        def __init__(self, *args, **kwargs):
            super().__init__(*args, client=_state["client"], cache_weights=False, **kwargs)

        def forward(self, lin_weight, _input, target, bias=None):
            return _as_liger_output(super().forward(lin_weight, _input, target, bias),
                                    liger_output_cls)

    liger_ops.LigerFusedLinearCrossEntropyFunction = LossdLigerFunction
    liger_functional.liger_fused_linear_cross_entropy = liger_fused_linear_cross_entropy
    liger_flce.LigerFusedLinearCrossEntropyLoss = LigerFusedLinearCrossEntropyLoss


def pytest_configure(config):
    import liger_kernel.ops as liger_ops
    import liger_kernel.transformers.functional as liger_functional
    import liger_kernel.transformers.fused_linear_cross_entropy as liger_flce

    _start_server()
    _install(liger_ops, liger_functional, liger_flce)


def pytest_unconfigure(config):
    proc = _state.get("proc")
    if proc is None:
        return
    _state["client"].close()
    proc.send_signal(signal.SIGTERM)
    try:
        proc.wait(timeout=15)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.wait()
