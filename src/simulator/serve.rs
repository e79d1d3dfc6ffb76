//! `sched-relay simulate` as a library call: load the scenarios, serve each VM on its port,
//! and the ARM stand-in when asked, print where each listens (tests and scripts read those
//! lines), then serve until `shutdown`.

use std::future::Future;
use std::net::SocketAddr;

use super::{ArmError, ArmOptions, ArmStandIn, FleetError, Scenario, Simulator};

/// What to serve.
pub struct ServePlan {
    pub listen: SocketAddr,
    /// Scenario files or built-in names, one VM each.
    pub scenarios: Vec<String>,
    /// Replaces every scenario's `time_scale`.
    pub time_scale: Option<f64>,
    /// The ARM stand-in's address and options, if it is wanted.
    pub arm: Option<(SocketAddr, ArmOptions)>,
}

/// Why nothing is served: `usage` when the scenarios or flags need fixing (exit 2), else a
/// failure of this machine (a port taken: exit 1).
#[derive(Debug)]
pub struct ServeError {
    pub message: String,
    pub usage: bool,
}

fn usage(message: impl ToString) -> ServeError {
    ServeError {
        message: message.to_string(),
        usage: true,
    }
}

/// Serves `plan` until `shutdown` completes.
pub async fn serve(plan: ServePlan, shutdown: impl Future<Output = ()>) -> Result<(), ServeError> {
    let mut scenarios = Vec::with_capacity(plan.scenarios.len());
    for name in &plan.scenarios {
        scenarios.push(Scenario::load(name).map_err(usage)?);
    }
    if let Some(scale) = plan.time_scale {
        if !(scale > 0.0 && scale.is_finite()) {
            return Err(usage(format!(
                "--time-scale {scale} must be a positive number"
            )));
        }
        for scenario in &mut scenarios {
            scenario.time_scale = scale;
        }
    }
    let simulators = Simulator::start_fleet(scenarios, plan.listen)
        .await
        .map_err(|error| ServeError {
            usage: matches!(error, FleetError::SharedEventDiffers { .. }),
            message: error.to_string(),
        })?;
    for simulator in &simulators {
        println!("sched-relay simulator listening on {}", simulator.url());
    }
    let arm = match plan.arm {
        None => None,
        Some((listen, options)) => {
            let vms: Vec<&Simulator> = simulators.iter().collect();
            match ArmStandIn::start(&vms, listen, options).await {
                Ok(stand_in) => {
                    println!("sched-relay simulator ARM listening on {}", stand_in.url());
                    Some(stand_in)
                }
                Err(error) => {
                    for simulator in simulators {
                        simulator.stop().await;
                    }
                    return Err(ServeError {
                        usage: !matches!(error, ArmError::Listen(..)),
                        message: error.to_string(),
                    });
                }
            }
        }
    };
    shutdown.await;
    if let Some(arm) = arm {
        arm.stop().await;
    }
    for simulator in simulators {
        simulator.stop().await;
    }
    Ok(())
}
