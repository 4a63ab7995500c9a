//! Random walks over the run, interrupt and tool-call state machines: valid moves are applied,
//! invalid ones refused and never applied, and every path follows the lifecycle of docs/architecture.md.

use keel_core::{InterruptStatus, RunStatus, ToolCallState};
use proptest::prelude::*;

/// Applies `to` if allowed; the state is unchanged otherwise.
fn step<S: Copy + PartialEq>(state: &mut S, to: S, allowed: bool, result: Result<S, keel_core::InvalidTransition>) {
    match result {
        Ok(next) => {
            assert!(allowed, "an invalid move was accepted");
            assert!(next == to);
            *state = next;
        }
        Err(_) => assert!(!allowed, "a valid move was refused"),
    }
}

/// The lifecycle, written independently of the code: (waiting →) queued → running → (interrupted →
/// running)* → completed | failed | cancelled (→ rolled_back); queued and interrupted runs may also
/// be cancelled or failed, a waiting one cancelled.
fn run_allowed(from: RunStatus, to: RunStatus) -> bool {
    use RunStatus::*;
    match from {
        Waiting => matches!(to, Queued | Cancelled),
        Queued => matches!(to, Running | Cancelled | Failed),
        Running => matches!(to, Interrupted | Completed | Failed | Cancelled),
        Interrupted => matches!(to, Running | Cancelled | Failed),
        Completed | Failed | Cancelled => to == RolledBack,
        RolledBack => false,
    }
}

fn run_status() -> impl Strategy<Value = RunStatus> {
    prop::sample::select(RunStatus::ALL.to_vec())
}

fn call_state() -> impl Strategy<Value = ToolCallState> {
    prop::sample::select(ToolCallState::ALL.to_vec())
}

fn interrupt_status() -> impl Strategy<Value = InterruptStatus> {
    prop::sample::select(InterruptStatus::ALL.to_vec())
}

proptest! {
    #![proptest_config(ProptestConfig::with_cases(2000))]

    #[test]
    fn runs_follow_the_lifecycle(waits in any::<bool>(), moves in prop::collection::vec(run_status(), 1..40)) {
        // A run starts queued, or waiting behind another (an enqueued message).
        let mut state = if waits { RunStatus::Waiting } else { RunStatus::Queued };
        let mut path = vec![state];
        for to in moves {
            let before = state;
            step(&mut state, to, run_allowed(before, to), before.transition(to));
            if state != before {
                path.push(state);
            }
        }
        // A terminal state is left only for a rollback, which nothing leaves; an active state never
        // follows a terminal one.
        if let Some(pos) = path.iter().position(|s| s.is_terminal()) {
            prop_assert!(path[pos + 1..].iter().all(|s| *s == RunStatus::RolledBack), "{:?}", path);
            prop_assert!(path.len() - pos <= 2, "{:?}", path);
        }
        // interrupted is always entered from running and left to running or an end; queued only
        // ever follows waiting (a queued message whose turn came), and nothing goes back to waiting.
        for w in path.windows(2) {
            if w[1] == RunStatus::Interrupted {
                prop_assert_eq!(w[0], RunStatus::Running);
            }
            if w[1] == RunStatus::Queued {
                prop_assert_eq!(w[0], RunStatus::Waiting);
            }
            prop_assert!(w[1] != RunStatus::Waiting, "nothing goes back to waiting");
            if w[1] == RunStatus::RolledBack {
                prop_assert!(matches!(w[0], RunStatus::Completed | RunStatus::Failed | RunStatus::Cancelled));
            }
        }
    }

    #[test]
    fn interrupts_resolve_once(moves in prop::collection::vec(interrupt_status(), 1..20)) {
        let mut state = InterruptStatus::Pending;
        let mut changes = 0;
        for to in moves {
            let before = state;
            let allowed = before == InterruptStatus::Pending && to != InterruptStatus::Pending;
            step(&mut state, to, allowed, before.transition(to));
            if state != before {
                changes += 1;
            }
        }
        prop_assert!(changes <= 1, "an interrupt leaves pending at most once");
    }

    #[test]
    fn tool_calls_execute_only_after_being_allowed(moves in prop::collection::vec(call_state(), 1..40)) {
        use ToolCallState::*;
        let mut state = Requested;
        let mut path = vec![state];
        for to in moves {
            let before = state;
            let allowed = before.can_transition_to(to);
            step(&mut state, to, allowed, before.transition(to));
            if state != before || (allowed && before == to) {
                path.push(state);
            }
        }
        for w in path.windows(2) {
            // A call starts executing only from allowed (or again, from executing, on recovery).
            if w[1] == Executing {
                prop_assert!(matches!(w[0], Allowed | Executing), "{:?}", path);
            }
            // Nothing leaves a settled state.
            prop_assert!(!(w[0].is_settled() && w[1] != w[0]), "{:?}", path);
        }
        // Side effects need a decision: `executing` never directly follows `requested` or `asking`.
        prop_assert!(!path.windows(2).any(|w| matches!(w[0], Requested | Asking) && w[1] == Executing));
    }
}
