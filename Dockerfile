# Multi-stage build: the agent is one binary on a slim base, run as non-root.
# FEATURES picks the sinks compiled in (nats, amqp, webhook are the defaults; kafka builds
# librdkafka from source with OpenSSL). An image for a coordinator with an `[azure]` section
# needs `--build-arg FEATURES="kafka azure"` (Azure Resource Manager's client; agents never
# need it, so the default leaves it out).
# The compiler deploy/symbol-order.txt was recorded with (its header says which): symbol names
# carry a hash of the compiler's version, and with another one the release binary's code
# keeps the default layout (build.rs; about 4 MiB more resident memory). The `dist` profile
# is the one that ships (Cargo.toml): fat LTO, optimised for size.
FROM rust:1.95.0-bookworm AS build
ARG FEATURES=kafka
WORKDIR /src
COPY . .
RUN cargo build --profile dist --locked --bin sched-relay --features "$FEATURES"

FROM debian:bookworm-slim
RUN apt-get update && apt-get install -y --no-install-recommends ca-certificates libssl3 \
    && rm -rf /var/lib/apt/lists/* \
    && useradd --system --uid 10001 --home-dir /var/lib/sched-relay sched-relay \
    && mkdir -p /var/lib/sched-relay /var/log/sched-relay \
    && chown sched-relay /var/lib/sched-relay /var/log/sched-relay
COPY --from=build /src/target/dist/sched-relay /usr/local/bin/sched-relay
USER sched-relay
ENTRYPOINT ["/usr/local/bin/sched-relay"]
CMD ["run"]
