use super::*;
use proptest::prelude::*;
use std::future::Future;

fn status(status: u16) -> ImdsError {
    ImdsError::Status {
        url: "u".into(),
        status,
        body: String::new(),
    }
}

fn throttled(retry_after: Option<u64>) -> ImdsError {
    ImdsError::Throttled {
        url: "u".into(),
        retry_after: retry_after.map(Duration::from_secs),
    }
}

#[test]
fn the_shipped_defaults_retry_an_outage_within_five_seconds_however_long_it_lasts() {
    let defaults = crate::imds::ImdsConfig::default();
    for failures in 1..10_000 {
        let wait = error_wait(
            &status(503),
            failures,
            defaults.poll_interval,
            defaults.max_backoff,
        );
        assert!(wait <= MAX_ERROR_BACKOFF, "{failures}: {wait:?}");
    }
}

#[test]
fn a_throttled_service_is_given_the_time_it_asks_for_up_to_a_preempt_notice() {
    let second = Duration::from_secs(1);
    let wait = |e| error_wait(&e, 1, second, MAX_ERROR_BACKOFF);
    assert_eq!(wait(throttled(Some(12))), Duration::from_secs(12));
    assert_eq!(wait(throttled(Some(600))), MAX_THROTTLED_WAIT);
    assert_eq!(wait(throttled(Some(0))), MIN_REQUEST_SPACING);
    let unasked = error_wait(&throttled(None), 30, second, MAX_ERROR_BACKOFF);
    assert!(unasked > MAX_ERROR_BACKOFF / 2 && unasked <= THROTTLED_BACKOFF);
    // The poll's own wait is never shorter than the hold the 429 set for every request
    // (else the log's `retry_in` would say a time the pacer does not keep).
    for _ in 0..100 {
        let first = error_wait(&throttled(None), 1, MIN_REQUEST_SPACING, MAX_ERROR_BACKOFF);
        assert!(first >= UNASKED_THROTTLE_HOLD, "{first:?}");
    }
}

proptest! {
    /// Any error, any count, any valid configuration: never faster than the service's
    /// budget, never slower than 5 s unless the service throttles.
    #[test]
    fn error_waits_stay_between_the_budget_and_the_ceiling(
        failures in 1u32..100_000,
        poll_ms in 200u64..=60_000,
        max_ms in 200u64..=5_000,
        code in prop::sample::select(vec![400u16, 404, 410, 500, 502, 503, 504]),
    ) {
        let wait = error_wait(
            &status(code),
            failures,
            Duration::from_millis(poll_ms),
            Duration::from_millis(max_ms),
        );
        prop_assert!(wait >= MIN_REQUEST_SPACING);
        prop_assert!(wait <= MAX_ERROR_BACKOFF);
    }
}

/// A request that waits for its turn in a task of its own, and says when it got it.
fn spawn_turn(pacer: &std::sync::Arc<Pacer>) -> tokio::task::JoinHandle<Instant> {
    let pacer = pacer.clone();
    tokio::spawn(async move {
        pacer.turn().await;
        Instant::now()
    })
}

/// `count` requests that take their slots and are then polled no more (their runtime
/// stalled): kept, not dropped, for as long as the test holds them.
fn stalled(pacer: &Pacer, count: usize) -> Vec<std::pin::Pin<Box<impl Future<Output = ()> + '_>>> {
    let mut idle = std::task::Context::from_waker(std::task::Waker::noop());
    let mut waiters: Vec<_> = (0..count).map(|_| Box::pin(pacer.turn())).collect();
    for waiter in &mut waiters {
        assert!(waiter.as_mut().poll(&mut idle).is_pending());
    }
    waiters
}

#[tokio::test(start_paused = true)]
async fn a_retry_after_holds_back_every_request_of_the_client() {
    let pacer = Pacer::new();
    pacer.turn().await;
    let start = Instant::now();
    pacer.throttled(Duration::from_secs(4));
    pacer.turn().await;
    assert!(Instant::now() - start >= Duration::from_secs(4));
    pacer.throttled(Duration::from_secs(600));
    let start = Instant::now();
    pacer.turn().await;
    assert_eq!(Instant::now() - start, MAX_THROTTLED_WAIT);
}

#[tokio::test(start_paused = true)]
async fn a_retry_after_that_comes_while_a_request_waits_for_its_turn_holds_it_back() {
    let pacer = std::sync::Arc::new(Pacer::new());
    let start = Instant::now();
    pacer.turn().await;
    // Waits for its spacing behind the request that just went out...
    let waiting = spawn_turn(&pacer);
    // ...whose answer, a 429, comes before that wait ends.
    tokio::time::sleep(Duration::from_millis(100)).await;
    pacer.throttled(Duration::from_secs(4));
    let went = waiting.await.unwrap();
    assert!(
        went - start >= Duration::from_millis(4_100),
        "went out {:?} after the first request, inside the Retry-After",
        went - start
    );
}

/// The poll has a runtime of its own; approval POSTs share the main one. A request whose
/// runtime stops driving it while it waits for its turn must not stop the other's.
#[test]
fn a_request_whose_runtime_stalls_while_it_waits_does_not_hold_back_another_runtimes() {
    let pacer = std::sync::Arc::new(Pacer::new());
    let start = std::time::Instant::now();
    let stalled = tokio::runtime::Builder::new_current_thread()
        .enable_time()
        .build()
        .unwrap();
    stalled.block_on(async {
        pacer.turn().await;
        // Waits for its spacing behind the request that just went out; then its runtime
        // is driven no more (a current-thread runtime runs only inside `block_on`).
        tokio::spawn({
            let pacer = pacer.clone();
            async move { pacer.turn().await }
        });
        tokio::task::yield_now().await;
    });
    let other = tokio::runtime::Builder::new_current_thread()
        .enable_time()
        .build()
        .unwrap();
    let went =
        other.block_on(async { tokio::time::timeout(Duration::from_secs(5), pacer.turn()).await });
    assert!(
        went.is_ok(),
        "the other runtime's request never got its turn"
    );
    // It still keeps its distance from the first request and the slot the stalled one took.
    assert!(
        start.elapsed() >= 2 * MIN_REQUEST_SPACING,
        "{:?}",
        start.elapsed()
    );
    drop(stalled);
}

#[tokio::test(start_paused = true)]
async fn requests_a_429_holds_back_together_go_out_one_spacing_apart_after_it() {
    let pacer = std::sync::Arc::new(Pacer::new());
    let start = Instant::now();
    pacer.turn().await;
    // Four requests queue behind it, each with a slot of its own...
    let waiting: Vec<_> = (0..4).map(|_| spawn_turn(&pacer)).collect();
    // ...until a 429 comes, and its hold ends after all their slots.
    tokio::time::sleep(Duration::from_millis(100)).await;
    pacer.throttled(Duration::from_secs(2));
    let mut went = Vec::new();
    for task in waiting {
        went.push(task.await.unwrap() - start);
    }
    went.sort();
    assert!(went[0] >= Duration::from_millis(2_100), "{went:?}");
    for pair in went.windows(2) {
        assert!(pair[1] - pair[0] >= MIN_REQUEST_SPACING, "{went:?}");
    }
}

#[tokio::test(start_paused = true)]
async fn requests_that_gave_up_waiting_do_not_delay_the_next() {
    let pacer = std::sync::Arc::new(Pacer::new());
    let start = Instant::now();
    pacer.turn().await;
    let given_up: Vec<_> = (0..3).map(|_| spawn_turn(&pacer)).collect();
    tokio::time::sleep(Duration::from_millis(50)).await;
    for task in &given_up {
        task.abort();
    }
    for task in given_up {
        assert!(task.await.unwrap_err().is_cancelled());
    }
    pacer.turn().await;
    assert_eq!(Instant::now() - start, MIN_REQUEST_SPACING);
}

/// A waiter whose task is not polled again (its runtime stalled) must not cost every
/// later poll a spacing: a spacing after its slot, it delays nobody.
#[tokio::test(start_paused = true)]
async fn waiters_no_longer_polled_delay_others_only_until_a_spacing_after_their_slots() {
    let pacer = Pacer::new();
    let start = Instant::now();
    pacer.turn().await;
    let stalled = stalled(&pacer, 25);
    // The last stalled slot is 25 spacings after the first request: a request just
    // before a spacing after it still waits for that...
    let last = start + MIN_REQUEST_SPACING * 25;
    tokio::time::sleep_until(last + Duration::from_millis(150)).await;
    pacer.turn().await;
    assert_eq!(Instant::now(), last + MIN_REQUEST_SPACING);
    // ...and later ones, a poll a second, not at all.
    for _ in 0..3 {
        tokio::time::sleep(Duration::from_secs(1)).await;
        let asked = Instant::now();
        pacer.turn().await;
        assert_eq!(Instant::now(), asked);
    }
    drop(stalled);
}

#[tokio::test(start_paused = true)]
async fn requests_a_429_holds_back_go_out_in_the_order_they_came_with_later_ones_behind() {
    let pacer = std::sync::Arc::new(Pacer::new());
    let order = std::sync::Arc::new(std::sync::Mutex::new(Vec::new()));
    pacer.turn().await;
    let request = |name: &'static str| {
        let (pacer, order) = (pacer.clone(), order.clone());
        tokio::spawn(async move {
            pacer.turn().await;
            order.lock().unwrap().push(name);
        })
    };
    let first = request("A");
    tokio::time::sleep(Duration::from_millis(10)).await;
    let second = request("B");
    tokio::time::sleep(Duration::from_millis(10)).await;
    pacer.throttled(Duration::from_secs(1));
    tokio::time::sleep(Duration::from_millis(10)).await;
    let third = request("C");
    for task in [first, second, third] {
        task.await.unwrap();
    }
    assert_eq!(*order.lock().unwrap(), ["A", "B", "C"]);
}

/// Runs `test` on a paused clock on a thread of its own, failing if it has not ended within
/// `limit` of real time: for a test whose fault is a loop that never yields (a tokio timeout
/// cannot end one).
fn ends_within<Test: Future<Output = ()>>(
    limit: std::time::Duration,
    test: impl FnOnce() -> Test + Send + 'static,
) {
    let (done, ended) = std::sync::mpsc::channel();
    std::thread::spawn(move || {
        tokio::runtime::Builder::new_current_thread()
            .enable_time()
            .start_paused(true)
            .build()
            .unwrap()
            .block_on(test());
        let _ = done.send(());
    });
    match ended.recv_timeout(limit) {
        Ok(()) => {}
        Err(std::sync::mpsc::RecvTimeoutError::Timeout) => {
            panic!("still running after {limit:?}: it spins, or waits for ever")
        }
        Err(std::sync::mpsc::RecvTimeoutError::Disconnected) => panic!("it failed (above)"),
    }
}

/// A waiter polled again long after its slot, with another request gone meanwhile, takes
/// a new slot a spacing after that one (and does not spin on its old one).
#[test]
fn a_waiter_polled_late_after_another_went_waits_a_spacing_after_it() {
    ends_within(std::time::Duration::from_secs(20), || async {
        let pacer = Pacer::new();
        let start = Instant::now();
        pacer.turn().await;
        let late = stalled(&pacer, 1).remove(0);
        tokio::time::sleep(MIN_REQUEST_SPACING * 2 + Duration::from_millis(40)).await;
        let other = Instant::now();
        pacer.turn().await;
        assert_eq!(Instant::now(), other);
        tokio::time::sleep(Duration::from_millis(10)).await;
        late.await;
        assert_eq!(Instant::now(), other + MIN_REQUEST_SPACING);
        assert!(Instant::now() - start > MIN_REQUEST_SPACING * 3);
    });
}

/// Moving the waiting slots leaves those more than a spacing past (waiters no longer polled)
/// where they are, except the slot of the waiter that moves them: polled late, it keeps its
/// place ahead of those that came after it.
#[test]
fn respacing_skips_stale_slots_but_not_the_late_waiters_own() {
    let start = Instant::now();
    let at = |ms: u64| start + Duration::from_millis(ms);
    let schedule = |waiting: &[(u64, u64)]| Schedule {
        waiting: waiting.iter().map(|(id, ms)| (*id, at(*ms))).collect(),
        ..Schedule::default()
    };
    let slots = |schedule: &Schedule| -> Vec<(u64, u64)> {
        let ms = |slot: Instant| (slot - start).as_millis() as u64;
        schedule
            .waiting
            .iter()
            .map(|(id, slot)| (*id, ms(*slot)))
            .collect()
    };
    let mut by_the_late_one = schedule(&[(1, 210), (2, 630)]);
    by_the_late_one.respace(at(630), at(500), 1);
    assert_eq!(slots(&by_the_late_one), [(1, 630), (2, 840)]);
    let mut by_another = schedule(&[(1, 210), (2, 630)]);
    by_another.respace(at(630), at(500), 2);
    assert_eq!(slots(&by_another), [(1, 210), (2, 630)]);
}

/// A 429 moves the slots of those waiting; one still asleep on its old, earlier slot must
/// not go out ahead of those that came before it.
#[tokio::test(start_paused = true)]
async fn a_waiter_asleep_on_a_slot_a_429_moved_does_not_overtake_those_ahead() {
    let pacer = std::sync::Arc::new(Pacer::new());
    let order = std::sync::Arc::new(std::sync::Mutex::new(Vec::new()));
    pacer.turn().await;
    let mut waiting = Vec::new();
    for n in 1..=5 {
        let (pacer, order) = (pacer.clone(), order.clone());
        waiting.push(tokio::spawn(async move {
            pacer.turn().await;
            order.lock().unwrap().push((n, Instant::now()));
        }));
        tokio::task::yield_now().await;
    }
    tokio::time::sleep(Duration::from_millis(50)).await;
    // The hold ends when the last of them was to go (1050 ms): their slots move behind it.
    pacer.throttled(Duration::from_secs(1));
    for task in waiting {
        task.await.unwrap();
    }
    let order = order.lock().unwrap();
    let names: Vec<_> = order.iter().map(|(n, _)| *n).collect();
    assert_eq!(names, [1, 2, 3, 4, 5]);
    for pair in order.windows(2) {
        assert_eq!(pair[1].1 - pair[0].1, MIN_REQUEST_SPACING, "{order:?}");
    }
}

/// A 429 moves the slots of those waiting, but not those of waiters no longer polled: else
/// each stalled waiter would hold every later request back by a spacing again.
#[tokio::test(start_paused = true)]
async fn a_429_does_not_move_the_slots_of_waiters_no_longer_polled() {
    let pacer = Pacer::new();
    let start = Instant::now();
    pacer.turn().await;
    let stalled = stalled(&pacer, 25);
    tokio::time::sleep_until(start + Duration::from_secs(6)).await;
    pacer.throttled(Duration::from_secs(1));
    pacer.turn().await;
    assert_eq!(Instant::now(), start + Duration::from_secs(7));
    drop(stalled);
}

#[tokio::test(start_paused = true)]
async fn requests_are_spaced_so_no_second_holds_more_than_five() {
    let pacer = Pacer::new();
    let start = Instant::now();
    let mut at = Vec::new();
    for _ in 0..20 {
        pacer.turn().await;
        at.push(Instant::now() - start);
    }
    for pair in at.windows(2) {
        assert!(pair[1] - pair[0] >= MIN_REQUEST_SPACING, "{at:?}");
    }
    for (i, first) in at.iter().enumerate() {
        let within = at[i..]
            .iter()
            .take_while(|t| **t <= *first + Duration::from_secs(1))
            .count();
        assert!(
            within <= 5,
            "{within} requests within a second of {first:?}"
        );
    }
}
