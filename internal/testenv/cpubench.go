package testenv

import (
	"context"
	"testing"
)

// ServerMeters is a CPUMeter of this process (self), the PostgreSQL
// backends of databaseURL's database (pg) and the Redis server at redisURL
// (redis), and one of the whole PostgreSQL server (pg_server), which other
// tests share: what a benchmark of a service running in its own process
// reads around each timed part.
func ServerMeters(b *testing.B, databaseURL, redisURL string) (meter, server CPUMeter) {
	b.Helper()
	ctx := context.Background()
	pg, closePG, err := PostgresDatabaseCPU(ctx, databaseURL)
	if err != nil {
		b.Fatal(err)
	}
	b.Cleanup(closePG)
	pgServer, err := PostgresCPUFunc(ctx, databaseURL)
	if err != nil {
		b.Fatal(err)
	}
	rd, err := RedisCPUFunc(ctx, redisURL)
	if err != nil {
		b.Fatal(err)
	}
	return CPUMeter{"self": SelfCPU, "pg": pg, "redis": rd}, CPUMeter{"pg_server": pgServer}
}

// ReadCPU reads meter, failing b on an error.
func ReadCPU(b *testing.B, meter CPUMeter) CPUReading {
	b.Helper()
	r, err := meter.Read()
	if err != nil {
		b.Fatal(err)
	}
	return r
}

// ReportCPUPerGiB reports the CPU seconds per GiB of bytes moved of the
// work measured (cpu, each of its parts too: <part>_cpu_s/GiB) and of its
// baseline (raw: raw_<part>_cpu_s/GiB), their totals (cpu_s/GiB,
// raw_cpu_s/GiB) and ratio (cpu/raw); and, apart, the server-wide readings
// of info.
func ReportCPUPerGiB(b *testing.B, bytes float64, cpu, raw, info CPUReading) {
	gib := bytes / (1 << 30)
	for name, d := range cpu {
		b.ReportMetric(d.Seconds()/gib, name+"_cpu_s/GiB")
	}
	for name, d := range raw {
		b.ReportMetric(d.Seconds()/gib, "raw_"+name+"_cpu_s/GiB")
	}
	for name, d := range info {
		b.ReportMetric(d.Seconds()/gib, name+"_cpu_s/GiB")
	}
	b.ReportMetric(cpu.Total().Seconds()/gib, "cpu_s/GiB")
	b.ReportMetric(raw.Total().Seconds()/gib, "raw_cpu_s/GiB")
	b.ReportMetric(cpu.Total().Seconds()/raw.Total().Seconds(), "cpu/raw")
}

// WatchMachineBusy starts watching the machine's busy fraction; the
// function it returns reports it (machine_busy, 0–1): how contended the
// measurement was.
func WatchMachineBusy(b *testing.B) func() {
	b.Helper()
	busy0, total0, err := MachineCPU()
	if err != nil {
		b.Fatal(err)
	}
	return func() {
		busy, total, err := MachineCPU()
		if err != nil {
			b.Fatal(err)
		}
		b.ReportMetric(float64(busy-busy0)/float64(total-total0), "machine_busy")
	}
}
