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

/// Takes the whole budget at once: the next request waits for the window.
async fn spend_the_budget(pacer: &Pacer) {
    for _ in 0..BUDGET {
        pacer.turn().await;
    }
}

#[tokio::test(start_paused = true)]
async fn requests_within_the_budget_go_at_once_and_the_next_waits_for_the_window() {
    let pacer = Pacer::new();
    let start = Instant::now();
    // A poll, then an approval's fresh GET and its POST, and two more: none waits.
    spend_the_budget(&pacer).await;
    assert_eq!(Instant::now(), start);
    pacer.turn().await;
    assert_eq!(Instant::now(), start + BUDGET_WINDOW);
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
    spend_the_budget(&pacer).await;
    // Waits for the window behind the requests that just went out...
    let waiting = spawn_turn(&pacer);
    // ...one of whose answers, a 429, comes before that wait ends.
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
        spend_the_budget(&pacer).await;
        // Waits for the window behind the requests that just went out; then its runtime
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
    // It still keeps within the budget the first requests spent.
    assert!(start.elapsed() >= BUDGET_WINDOW, "{:?}", start.elapsed());
    drop(stalled);
}

#[tokio::test(start_paused = true)]
async fn requests_a_429_holds_back_together_go_out_one_spacing_apart_after_it() {
    let pacer = std::sync::Arc::new(Pacer::new());
    let start = Instant::now();
    spend_the_budget(&pacer).await;
    // Four requests queue behind them, each with a slot of its own...
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
async fn after_a_429_requests_are_spaced_for_a_while_then_counted_again() {
    let pacer = Pacer::new();
    pacer.turn().await;
    pacer.throttled(Duration::ZERO);
    let start = Instant::now();
    for n in 1..=3 {
        pacer.turn().await;
        assert_eq!(Instant::now(), start + MIN_REQUEST_SPACING * n);
    }
    tokio::time::sleep(SPACED_AFTER_THROTTLE).await;
    let start = Instant::now();
    spend_the_budget(&pacer).await;
    assert_eq!(Instant::now(), start);
}

#[tokio::test(start_paused = true)]
async fn requests_that_gave_up_waiting_do_not_delay_the_next() {
    let pacer = std::sync::Arc::new(Pacer::new());
    let start = Instant::now();
    spend_the_budget(&pacer).await;
    // A whole budget's worth of requests queue for the window, and give up.
    let given_up: Vec<_> = (0..BUDGET).map(|_| spawn_turn(&pacer)).collect();
    tokio::time::sleep(Duration::from_millis(50)).await;
    for task in &given_up {
        task.abort();
    }
    for task in given_up {
        assert!(task.await.unwrap_err().is_cancelled());
    }
    pacer.turn().await;
    assert_eq!(Instant::now() - start, BUDGET_WINDOW);
}

/// A waiter whose task is not polled again (its runtime stalled) must not cost every
/// later poll a window: a spacing after its slot, it delays nobody.
#[tokio::test(start_paused = true)]
async fn waiters_no_longer_polled_delay_others_only_until_a_spacing_after_their_slots() {
    let pacer = Pacer::new();
    let start = Instant::now();
    spend_the_budget(&pacer).await;
    let stalled = stalled(&pacer, 25);
    // The last five stalled slots are five windows after the first request: a request just
    // before a spacing after them still counts them...
    let last = start + BUDGET_WINDOW * 5;
    tokio::time::sleep_until(last + Duration::from_millis(150)).await;
    pacer.turn().await;
    assert_eq!(Instant::now(), last + BUDGET_WINDOW);
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
    spend_the_budget(&pacer).await;
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
    // Longer than the window they wait for: the hold decides when they go.
    pacer.throttled(Duration::from_secs(2));
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

/// A waiter polled again long after its slot, with a budget's worth of others gone
/// meanwhile, takes a new slot a window after the first of them (and does not spin on its
/// old one).
#[test]
fn a_waiter_polled_late_after_others_went_waits_for_the_window_behind_them() {
    ends_within(std::time::Duration::from_secs(20), || async {
        let pacer = Pacer::new();
        let start = Instant::now();
        spend_the_budget(&pacer).await;
        let late = stalled(&pacer, 1).remove(0);
        tokio::time::sleep(BUDGET_WINDOW + MIN_REQUEST_SPACING + Duration::from_millis(40)).await;
        let others = Instant::now();
        spend_the_budget(&pacer).await;
        assert_eq!(Instant::now(), others);
        tokio::time::sleep(Duration::from_millis(10)).await;
        late.await;
        assert_eq!(Instant::now(), others + BUDGET_WINDOW);
        assert!(Instant::now() - start > BUDGET_WINDOW * 2);
    });
}

/// Working the slots out again leaves those more than a spacing past (waiters no longer
/// polled) where they are, except the slot of the waiter that does it: polled late, it keeps
/// its place ahead of those that came after it.
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
    // Four grants at the start: the late one's own slot counts, so the one behind it waits
    // for the window...
    let granted: std::collections::VecDeque<Instant> = [at(0); 4].into();
    let mut by_the_late_one = schedule(&[(1, 100), (2, 600)]);
    by_the_late_one.granted = granted.clone();
    by_the_late_one.respace(at(500), 1);
    assert_eq!(slots(&by_the_late_one), [(1, 100), (2, 1050)]);
    // ...but a stale slot that is not the waker's own counts for nobody.
    let mut by_another = schedule(&[(1, 100), (2, 600)]);
    by_another.granted = granted;
    by_another.respace(at(500), 2);
    assert_eq!(slots(&by_another), [(1, 100), (2, 600)]);
}

/// A 429 moves the slots of those waiting; one still asleep on its old, earlier slot must
/// not go out ahead of those that came before it.
#[tokio::test(start_paused = true)]
async fn a_waiter_asleep_on_a_slot_a_429_moved_does_not_overtake_those_ahead() {
    let pacer = std::sync::Arc::new(Pacer::new());
    let order = std::sync::Arc::new(std::sync::Mutex::new(Vec::new()));
    spend_the_budget(&pacer).await;
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
    // The hold ends when they were all to go (the window): their slots move behind it.
    pacer.throttled(BUDGET_WINDOW - Duration::from_millis(50));
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
/// each stalled waiter would hold every later request back again.
#[tokio::test(start_paused = true)]
async fn a_429_does_not_move_the_slots_of_waiters_no_longer_polled() {
    let pacer = Pacer::new();
    let start = Instant::now();
    spend_the_budget(&pacer).await;
    let stalled = stalled(&pacer, 25);
    tokio::time::sleep_until(start + Duration::from_secs(6)).await;
    pacer.throttled(Duration::from_secs(1));
    pacer.turn().await;
    assert_eq!(Instant::now(), start + Duration::from_secs(7));
    drop(stalled);
}

#[tokio::test(start_paused = true)]
async fn requests_back_to_back_never_hold_more_than_five_in_any_second() {
    let pacer = Pacer::new();
    let start = Instant::now();
    let mut at = Vec::new();
    for _ in 0..20 {
        pacer.turn().await;
        at.push(Instant::now() - start);
    }
    assert_eq!(at[..BUDGET], [Duration::ZERO; BUDGET], "{at:?}");
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

proptest! {
    /// Requests at any moments, from tasks that come and go: no second ever holds more
    /// than five grants, and every request is granted within a window of the budget
    /// allowing it (no request waits for nothing).
    #[test]
    fn no_second_holds_more_than_five_requests_whenever_they_come(
        arrivals in prop::collection::vec(0u64..4_000, 1..40),
    ) {
        let grants = tokio::runtime::Builder::new_current_thread()
            .enable_time()
            .start_paused(true)
            .build()
            .unwrap()
            .block_on(async {
                let pacer = std::sync::Arc::new(Pacer::new());
                let start = Instant::now();
                let tasks: Vec<_> = arrivals
                    .iter()
                    .map(|ms| {
                        let pacer = pacer.clone();
                        let arrive = start + Duration::from_millis(*ms);
                        tokio::spawn(async move {
                            tokio::time::sleep_until(arrive).await;
                            pacer.turn().await;
                            (arrive - start, Instant::now() - start)
                        })
                    })
                    .collect();
                let mut grants = Vec::new();
                for task in tasks {
                    grants.push(task.await.unwrap());
                }
                grants
            });
        let mut at: Vec<Duration> = grants.iter().map(|(_, granted)| *granted).collect();
        at.sort();
        for pair in at.windows(BUDGET + 1) {
            prop_assert!(pair[BUDGET] - pair[0] >= BUDGET_WINDOW, "{at:?}");
        }
        // A request waits only while the budget is spent: at its arrival, or exactly a
        // window after a grant.
        for (arrived, granted) in &grants {
            prop_assert!(
                granted == arrived || at.iter().any(|g| *g + BUDGET_WINDOW == *granted),
                "{arrived:?} granted at {granted:?}, a wait the budget does not explain: {at:?}"
            );
        }
    }
}

/// A waiter no longer polled is not carried forward by the wakes of others: a spacing after
/// its slot it no longer takes a place in the budget, however often others ask.
#[tokio::test(start_paused = true)]
async fn a_stalled_waiter_is_not_kept_alive_by_the_requests_after_it() {
    let pacer = std::sync::Arc::new(Pacer::new());
    let start = Instant::now();
    spend_the_budget(&pacer).await;
    let stalled = stalled(&pacer, 1);
    // Requests every 100 ms from the stalled one's slot (the window) on: were its slot moved
    // up at each wake, it would stay live and hold one place of every window.
    tokio::time::sleep_until(start + BUDGET_WINDOW + Duration::from_millis(1)).await;
    let mut granted = Vec::new();
    for _ in 0..30 {
        let asked = Instant::now();
        pacer.turn().await;
        granted.push(Instant::now() - asked);
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    // Five each window once it is stale: the first five go at once.
    assert_eq!(granted[..BUDGET], [Duration::ZERO; BUDGET], "{granted:?}");
    drop(stalled);
}
