import os
import signal

import pytest

from ropelab.train.stop import EX_TEMPFAIL, INTERRUPTED, StoppedBySignal, StopSignals


def send(signum):
    os.kill(os.getpid(), signum)  # the handler runs before the next bytecode


def test_the_first_signal_is_kept_and_repeated_sigterms_are_ignored():
    before = signal.getsignal(signal.SIGTERM)
    with StopSignals() as stop:
        assert stop.signum is None
        send(signal.SIGUSR1)
        send(signal.SIGTERM)
        send(signal.SIGTERM)
        assert stop.signum == signal.SIGUSR1 and stop.received == [signal.SIGUSR1, signal.SIGTERM, signal.SIGTERM]
    assert signal.getsignal(signal.SIGTERM) is before


def test_a_ctrl_c_after_a_stop_signal_interrupts_at_once():
    with StopSignals() as stop:
        send(signal.SIGINT)
        assert stop.signum == signal.SIGINT
        with pytest.raises(KeyboardInterrupt):
            send(signal.SIGINT)
    assert signal.getsignal(signal.SIGINT) is signal.default_int_handler


def test_a_study_records_every_signal_to_forward_it():
    with StopSignals(second_interrupt_aborts=False) as stop:
        send(signal.SIGINT)
        send(signal.SIGINT)
        assert stop.received == [signal.SIGINT, signal.SIGINT]


@pytest.mark.parametrize("signum, code", [(signal.SIGTERM, EX_TEMPFAIL), (signal.SIGUSR1, EX_TEMPFAIL),
                                          (None, EX_TEMPFAIL), (signal.SIGINT, INTERRUPTED)])
def test_exit_codes(signum, code):
    stopped = StoppedBySignal(signum, "run: stopped")
    assert stopped.exit_code == code and isinstance(stopped, KeyboardInterrupt)
