from worker_agent.sequencer import Action, Sequencer


def test_in_order_batches_apply_and_a_jump_is_a_gap_from_the_expected_seq():
    seq = Sequencer()
    assert seq.classify(0, 100).action is Action.APPLY
    seq.applied(0, 100)
    assert seq.classify(1, 101).action is Action.APPLY
    seq.applied(1, 101)
    decision = seq.classify(5, 105)
    assert (decision.action, decision.missing_from) == (Action.GAP, 2)


def test_a_first_batch_after_zero_means_the_history_is_missing():
    decision = Sequencer().classify(7, 1)
    assert (decision.action, decision.missing_from) == (Action.GAP, 0)


def test_a_seen_batch_is_a_duplicate_and_a_different_one_a_restart():
    seq = Sequencer()
    for n in range(4):
        seq.applied(n, 100 + n)
    assert seq.classify(2, 102).action is Action.DUPLICATE
    assert seq.classify(0, 999).action is Action.RESTART  # a new process's seq 0 has another payload
    assert seq.classify(2, 555).action is Action.RESTART


def test_the_duplicate_window_is_bounded():
    seq = Sequencer(recent=3)
    for n in range(10):
        seq.applied(n, n)
    assert seq.classify(9, 9).action is Action.DUPLICATE
    assert seq.classify(2, 2).action is Action.RESTART  # forgotten: treated as a new process
    seq.reset()
    assert seq.expected is None
