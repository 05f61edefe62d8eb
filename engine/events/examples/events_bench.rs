//! Measures end-to-end KV event throughput: one producer thread submits single-block
//! `BlockStored` events through an `EventSink`; a connected SUB on loopback receives every
//! batch and decodes it with Dynamo's own parser. Fails unless every event arrives, with
//! consecutive sequence numbers and no drops.
//!
//! Run: `cargo run --release -p kvnode-events --example events_bench -- [EVENTS] [BLOCK_SIZE]`
//! (defaults: 1 000 000 events, 16 tokens per block).

use std::time::{Duration, Instant};

use dynamo_kv_router::zmq_wire::decode_event_batch;
use kvnode_events::{Access, BlockStored, Medium, Publisher, PublisherConfig, SinkError};
use zeromq::{Socket, SocketRecv, SubSocket};

const PROBE: u64 = u64::MAX;

fn main() -> Result<(), Box<dyn std::error::Error>> {
    let mut args = std::env::args().skip(1);
    let events: u64 = args.next().map_or(Ok(1_000_000), |a| a.parse())?;
    let block_size: u32 = args.next().map_or(Ok(16), |a| a.parse())?;
    let config = PublisherConfig {
        // Room for the whole run, so the measurement shows the pipeline, not drop policy.
        queue_capacity: usize::try_from(events)? + 1024,
        // Loopback on a dev machine: tcp is allowed only by saying so.
        access: Access {
            tcp_readable_by_anyone: true,
            ..Access::default()
        },
        ..PublisherConfig::new("tcp://127.0.0.1:0").with_replay("tcp://127.0.0.1:0")
    };
    let max_batch = config.max_batch_events;
    let publisher = Publisher::start(config)?;
    let sink = publisher.sink();
    let rt = tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()?;

    let (first_seq, mut sub) = rt.block_on(async {
        let mut sub = SubSocket::new();
        sub.connect(publisher.endpoint()).await?;
        sub.subscribe("").await?;
        // Warm-up: wait until a probe batch arrives, so the subscription is live.
        loop {
            sink.removed(Medium::CpuPinned, vec![PROBE])?;
            if let Ok(msg) = tokio::time::timeout(Duration::from_millis(50), sub.recv()).await {
                let seq = u64::from_be_bytes(msg?.get(1).ok_or("no seq")?[..].try_into()?);
                return Ok::<_, Box<dyn std::error::Error>>((seq, sub));
            }
        }
    })?;

    let start = Instant::now();
    let producer = std::thread::spawn(move || -> Result<Duration, SinkError> {
        let tokens: Vec<u32> = (0..block_size).collect();
        for i in 0..events {
            let parent = i.checked_sub(1);
            sink.stored(
                BlockStored::new(Medium::CpuPinned, block_size)
                    .with_parent(parent)
                    .block(i, &tokens),
            )?;
        }
        Ok(start.elapsed())
    });

    let (received, batches) = rt.block_on(async {
        let (mut received, mut batches, mut next) = (0u64, 0u64, first_seq + 1);
        while received < events {
            let msg = tokio::time::timeout(Duration::from_secs(10), sub.recv())
                .await
                .map_err(|_| format!("stalled after {received} of {events} events"))??;
            let seq = u64::from_be_bytes(msg.get(1).ok_or("no seq")?[..].try_into()?);
            if seq != next {
                return Err(format!("gap: expected seq {next}, got {seq}").into());
            }
            next += 1;
            batches += 1;
            let batch = decode_event_batch(msg.get(2).ok_or("no payload")?)?;
            received += batch
                .events
                .iter()
                .filter(|e| e.event_type_label() == "stored")
                .count() as u64;
        }
        Ok::<_, Box<dyn std::error::Error>>((received, batches))
    })?;
    let elapsed = start.elapsed();
    let submit = producer.join().map_err(|_| "producer panicked")??;
    let stats = publisher.shutdown();

    let rate = received as f64 / elapsed.as_secs_f64();
    println!(
        "events_bench: {received} block events in {batches} batches (max {max_batch}/batch), \
         block_size {block_size}"
    );
    println!(
        "  submit {:.0} ev/s; end-to-end (decoded by dynamo at the SUB) {rate:.0} ev/s in {:.3} s",
        events as f64 / submit.as_secs_f64(),
        elapsed.as_secs_f64()
    );
    println!(
        "  {} bytes published, dropped {}, rejected {}",
        stats.bytes,
        stats.dropped_total(),
        stats.rejected_total()
    );
    if received != events || stats.dropped_total() != 0 {
        return Err("lost events".into());
    }
    if rate < 100_000.0 {
        return Err(format!("{rate:.0} ev/s is below the 100 000 ev/s target").into());
    }
    Ok(())
}
