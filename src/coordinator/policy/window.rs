//! Maintenance windows: the days and times (UTC) when a group may be drained and its events
//! approved early. Outside them the coordinator waits; Azure's own starts still happen at
//! NotBefore and count against the budget.

use chrono::{DateTime, Datelike, Timelike, Utc, Weekday};

/// Days of the week and a time range, UTC. `from` after `to` runs past midnight into the
/// next day (the day named is the one it starts on); `from` equal to `to` is the whole day.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Window {
    /// Monday first; all false is not allowed (the parser turns "every day" into all true).
    pub days: [bool; 7],
    /// Minutes after midnight.
    pub from: u32,
    pub to: u32,
}

impl Window {
    pub fn contains(&self, now: DateTime<Utc>) -> bool {
        let minute = now.hour() * 60 + now.minute();
        let today = now.weekday().num_days_from_monday() as usize;
        let yesterday = (today + 6) % 7;
        if self.from == self.to {
            return self.days[today];
        }
        if self.from < self.to {
            return self.days[today] && self.from <= minute && minute < self.to;
        }
        (self.days[today] && minute >= self.from) || (self.days[yesterday] && minute < self.to)
    }

    /// Parses `days` (`mon`..`sun`, or `mon-fri`; empty: every day) and `HH:MM` times.
    pub fn parse(days: &[String], from: &str, to: &str) -> Result<Window, String> {
        let minutes = |text: &str| -> Result<u32, String> {
            let (h, m) = text
                .split_once(':')
                .ok_or_else(|| format!("{text:?} is not a time like \"02:00\""))?;
            match (h.parse::<u32>(), m.parse::<u32>()) {
                (Ok(h_), Ok(m_)) if h.len() == 2 && m.len() == 2 && h_ < 24 && m_ < 60 => {
                    Ok(h_ * 60 + m_)
                }
                _ => Err(format!(
                    "{text:?} is not a time like \"02:00\" (00:00 to 23:59)"
                )),
            }
        };
        let day = |text: &str| -> Result<usize, String> {
            text.parse::<Weekday>()
                .map(|d| d.num_days_from_monday() as usize)
                .map_err(|_| format!("{text:?} is not a day (mon, tue, ... sun)"))
        };
        let mut set = [days.is_empty(); 7];
        for entry in days {
            match entry.split_once('-') {
                Some((first, last)) => {
                    let (first, last) = (day(first)?, day(last)?);
                    let mut d = first;
                    loop {
                        set[d] = true;
                        if d == last {
                            break;
                        }
                        d = (d + 1) % 7;
                    }
                }
                None => set[day(entry)?] = true,
            }
        }
        Ok(Window {
            days: set,
            from: minutes(from)?,
            to: minutes(to)?,
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use chrono::TimeZone;

    fn at(day: u32, hour: u32, minute: u32) -> DateTime<Utc> {
        // 2026-11-23 is a Monday.
        Utc.with_ymd_and_hms(2026, 11, 23 + day, hour, minute, 0)
            .unwrap()
    }

    #[test]
    fn a_window_holds_its_days_and_times_and_one_past_midnight_runs_into_the_next_day() {
        let nights = Window::parse(&["sat-sun".into()], "22:00", "04:00").unwrap();
        assert!(nights.contains(at(5, 23, 0)), "Saturday 23:00");
        assert!(nights.contains(at(6, 3, 59)), "Sunday 03:59");
        assert!(nights.contains(at(7, 3, 0)), "Monday 03:00, Sunday's night");
        assert!(!nights.contains(at(7, 22, 0)), "Monday 22:00");
        assert!(
            !nights.contains(at(5, 4, 0)),
            "Saturday 04:00 is Friday's night"
        );
        let weekdays = Window::parse(&["mon-fri".into()], "09:00", "17:00").unwrap();
        assert!(weekdays.contains(at(0, 9, 0)));
        assert!(!weekdays.contains(at(0, 17, 0)));
        assert!(!weekdays.contains(at(5, 10, 0)));
        let always = Window::parse(&[], "00:00", "00:00").unwrap();
        assert!(always.contains(at(3, 12, 34)));
    }

    #[test]
    fn a_window_that_is_not_days_and_times_is_refused_with_what_was_expected() {
        assert!(
            Window::parse(&["someday".into()], "02:00", "04:00")
                .unwrap_err()
                .contains("not a day")
        );
        assert!(
            Window::parse(&[], "25:00", "04:00")
                .unwrap_err()
                .contains("not a time")
        );
        assert!(Window::parse(&[], "2am", "04:00").is_err());
    }
}
