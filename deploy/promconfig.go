package deploy

import (
	"errors"
	"fmt"
	"net"

	"gopkg.in/yaml.v3"
)

// ErrUnknownTarget reports a scrape target of PrometheusFile that the caller
// has no address for.
var ErrUnknownTarget = errors.New("scrape target not served")

// RetargetPrometheus rewrites the Prometheus configuration data
// (PrometheusFile) for a test: every static target (a compose service
// host:port) is replaced by addr(host), every scrape and evaluation
// interval and scrape timeout is set to interval, and the jobs' own
// intervals are dropped. It returns the new configuration and the number of
// targets; a target whose host addr does not know is ErrUnknownTarget.
func RetargetPrometheus(data []byte, interval string, addr func(host string) (string, bool)) ([]byte, int, error) {
	var cfg map[string]any
	if err := yaml.Unmarshal(data, &cfg); err != nil {
		return nil, 0, fmt.Errorf("%s: %w", PrometheusFile, err)
	}
	cfg["global"] = map[string]any{"scrape_interval": interval, "scrape_timeout": interval, "evaluation_interval": interval}
	scrapes, _ := cfg["scrape_configs"].([]any)
	n := 0
	for _, sc := range scrapes {
		job, _ := sc.(map[string]any)
		delete(job, "scrape_interval")
		delete(job, "scrape_timeout")
		statics, _ := job["static_configs"].([]any)
		for _, st := range statics {
			static, _ := st.(map[string]any)
			list, _ := static["targets"].([]any)
			for i, tg := range list {
				host, _, err := net.SplitHostPort(fmt.Sprint(tg))
				a, ok := addr(host)
				if err != nil || !ok {
					return nil, 0, fmt.Errorf("%s: job %v scrapes %v: %w", PrometheusFile, job["job_name"], tg, ErrUnknownTarget)
				}
				list[i] = a
				n++
			}
		}
	}
	out, err := yaml.Marshal(cfg)
	if err != nil {
		return nil, 0, fmt.Errorf("%s: %w", PrometheusFile, err)
	}
	return out, n, nil
}
