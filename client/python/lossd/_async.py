# SPDX-License-Identifier: Apache-2.0
"""Calls that return a concurrent.futures.Future instead of blocking: Client.compute_async and
ReplicaPool.compute_async, and call_async for any sequence of a client's calls (a retried
hosted-head Compute). A mixin over the synchronous methods; it never changes what a call
sends or what it raises.

Each client (or pool) owns one executor of `max_in_flight` threads (default 2), made on the
first asynchronous call: at most that many calls run at once, the rest wait in order, so the
client holds the outputs of at most max_in_flight calls being received (the server's
admission bounds its side). A future's exception is the LossdError subclass the synchronous
call raises, with the same request id; the caller's thread never waits on the network.
"""

import concurrent.futures
import threading

from lossd import errors

DEFAULT_MAX_IN_FLIGHT = 2


def check_max_in_flight(value):
    """max_in_flight as an int >= 1, or InvalidArgumentError naming it."""
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise errors.InvalidArgumentError(
            "max_in_flight must be an integer >= 1 (calls of this client in flight at once), "
            "got %r" % (value,))
    return value


class AsyncCalls:
    """compute_async and call_async over a class's compute (lossd.Client, ReplicaPool).

    The class calls init_async(max_in_flight) in its constructor and close_async() in close().
    """

    def init_async(self, max_in_flight):
        self.max_in_flight = check_max_in_flight(max_in_flight)
        self._executor = None
        self._executor_lock = threading.Lock()
        self._async_closed = False

    def _executor_for_call(self):
        with self._executor_lock:
            if self._async_closed:
                return None
            if self._executor is None:
                self._executor = concurrent.futures.ThreadPoolExecutor(
                    max_workers=self.max_in_flight, thread_name_prefix="lossd-call")
            return self._executor

    def call_async(self, fn, *args, **kwargs):
        """fn(*args, **kwargs) (calls of this client, e.g. a Compute retried) on this client's
        executor: a concurrent.futures.Future of its result, or of the exception it raised.
        Never blocks: beyond max_in_flight running calls the call waits in order, and
        future.cancel() succeeds until it starts (a started call runs to its end: a Compute
        into an accumulator or a head is added or fails as it would have). On a closed client
        the future holds ClientClosedError."""
        ex = self._executor_for_call()
        if ex is not None:
            try:
                return ex.submit(fn, *args, **kwargs)
            except RuntimeError:  # shut down between the check and the submit
                pass
        fut = concurrent.futures.Future()
        fut.set_exception(errors.ClientClosedError(
            "this %s (%s) was closed; make a new one" % (type(self).__name__, self.target),
            method="compute_async"))
        return fut

    def compute_async(self, x, w, targets, **kwargs):
        """compute(x, w, targets, **kwargs) without waiting: a concurrent.futures.Future whose
        result() is the ComputeResult (result(timeout) raises concurrent.futures.TimeoutError
        while the call is still running), and whose exception() is the LossdError subclass
        compute raises, request id included. Up to max_in_flight calls run at once, each its
        own gRPC stream (on the client's connections, round-robin); a hosted head's (rank,
        micro_batch) keys and an accumulator's instance check mean what they mean for compute.
        x, w and the other inputs are read while the call runs: leave them unchanged until the
        future is done (as with a non_blocking copy)."""
        return self.call_async(self.compute, x, w, targets, **kwargs)

    def close_async(self):
        """Cancels the calls not started; those running end with the channels' closing."""
        with self._executor_lock:
            self._async_closed = True
            ex, self._executor = self._executor, None
        if ex is not None:
            ex.shutdown(wait=False, cancel_futures=True)
