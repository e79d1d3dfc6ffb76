//! Lays out the shipped binary's code in the order an agent runs it (benches/profiling.md,
//! section 16).
//!
//! `deploy/symbol-order.txt` lists the functions agents ran, idle polls first, then the rest
//! of start-up, then events and the stop, as `scripts/symbol-order` recorded them. Handed to
//! the linker, they sit side by side. The kernel maps an executable's pages in 64 KiB runs
//! around each one touched: with the code an agent runs spread over the whole text, an idle
//! agent kept nearly all of it resident (7.3 MiB of 7.8), against 2.9 MiB laid out in order.
//!
//! Builds of the profiles that inherit from `release` (`dist`, which ships and for which the
//! list was recorded, `profiling`, `bench`, and `release` itself, whose names it mostly does
//! not match) for Linux use it, and only where the linker takes `--symbol-ordering-file`:
//! LLD, Rust's default on x86_64 Linux since 1.90. A one-line program linked here with the
//! same compiler, target, flags and linker proves it; elsewhere the build goes on as before.
//! A name the build does not have (a dependency updated since, another feature set) is
//! skipped: symbol names carry a hash of the compiler, the profile and each crate's version
//! and features. The order moves code, it never changes what is built.
//!
//! Such builds also write, to OUT_DIR, the linker's map (`sched-relay.map`), from which
//! `scripts/symbol-order` names the functions it saw run, and what was decided and why
//! (`symbol-order.status`). With both, `scripts/symbol-order --check` says whether the list
//! went stale. `cargo bench --profile dist` shares that OUT_DIR with `cargo build --profile
//! dist` (the same build script run) and writes the map of its own binary there; the check
//! tells them apart.

use std::env;
use std::path::{Path, PathBuf};
use std::process::Command;

const ORDER: &str = "deploy/symbol-order.txt";
const BINARY: &str = "sched-relay";

fn main() {
    println!("cargo::rerun-if-changed={ORDER}");
    println!("cargo::rerun-if-changed=build.rs");
    // The profile's optimisation level, for `sched_relay::OPT_LEVEL` (the quick `release`
    // build says it is not the one that ships). A cfg, not `rustc-env`: cargo also sets such
    // variables when it runs the binary or its tests, and the configuration loader reads
    // every SCHED_RELAY_* variable as an override.
    let opt_level = env::var("OPT_LEVEL").expect("set by cargo");
    println!(
        "cargo::rustc-check-cfg=cfg(sched_relay_opt_level, values(\"0\", \"1\", \"2\", \"3\", \"s\", \"z\"))"
    );
    println!("cargo::rustc-cfg=sched_relay_opt_level=\"{opt_level}\"");
    let manifest = PathBuf::from(env::var_os("CARGO_MANIFEST_DIR").expect("set by cargo"));
    let out = PathBuf::from(env::var_os("OUT_DIR").expect("set by cargo"));
    // What was decided, for `scripts/symbol-order --check`: "laid out", or why not (in
    // parentheses where there is nothing to check).
    let status = out.join("symbol-order.status");
    if env::var("PROFILE").as_deref() != Ok("release")
        || env::var("CARGO_CFG_TARGET_OS").as_deref() != Ok("linux")
        || opt_level == "0"
    {
        // (The quick `release` build, unoptimised, is not laid out either: it is built to be
        // quick, and its names are not the list's.)
        let why = "not laid out: only optimised release builds for Linux are (not Linux or not release)\n";
        std::fs::write(&status, why).expect("OUT_DIR is writable");
        return;
    }
    let order = manifest.join(ORDER);
    let mut arguments = vec![format!(
        "-Wl,-Map={}",
        out.join(format!("{BINARY}.map")).display()
    )];
    if order.is_file() {
        arguments.push(format!(
            "-Wl,--symbol-ordering-file={},--no-warn-symbol-ordering",
            order.display()
        ));
    }
    let decided = match links_with(&out, &arguments) {
        Err(error) => format!(
            "not laid out: a program does not link with {} (not LLD): {error}\n",
            arguments.join(" ")
        ),
        Ok(()) => {
            for argument in &arguments {
                println!("cargo::rustc-link-arg-bin={BINARY}={argument}");
            }
            if order.is_file() {
                "laid out\n".into()
            } else {
                format!("not laid out: there is no {ORDER} (the map is written)\n")
            }
        }
    };
    std::fs::write(&status, decided).expect("OUT_DIR is writable");
}

/// Whether a program links as this package's binary does, with `arguments` added; if not,
/// the first line the compiler said.
fn links_with(out: &Path, arguments: &[String]) -> Result<(), String> {
    let source = out.join("probe.rs");
    std::fs::write(&source, "fn main() {}\n").map_err(|error| error.to_string())?;
    let rustc = env::var_os("RUSTC").unwrap_or_else(|| "rustc".into());
    let mut command = Command::new(rustc);
    command
        .arg("--crate-name=symbol_order_probe")
        .arg("--edition=2021")
        .arg(format!("--out-dir={}", out.display()))
        .arg(&source);
    for argument in arguments {
        // The probe's own map, not the binary's.
        let argument = argument.replace(&format!("{BINARY}.map"), "probe.map");
        command.arg("-C").arg(format!("link-arg={argument}"));
    }
    if let Ok(target) = env::var("TARGET") {
        command.arg(format!("--target={target}"));
    }
    if let Some(linker) = env::var_os("RUSTC_LINKER") {
        command
            .arg("-C")
            .arg(format!("linker={}", PathBuf::from(linker).display()));
    }
    if let Ok(flags) = env::var("CARGO_ENCODED_RUSTFLAGS") {
        command.args(flags.split('\u{1f}').filter(|flag| !flag.is_empty()));
    }
    let output = command.output().map_err(|error| error.to_string())?;
    if output.status.success() {
        return Ok(());
    }
    let said = String::from_utf8_lossy(&output.stderr);
    Err(said.lines().next().unwrap_or("no message").to_owned())
}
