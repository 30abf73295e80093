package main

import (
	"errors"
	"flag"
	"io"
	"testing"
)

// dlq --service picks the sender, the scheduler or the first gpuworker.
func TestDLQServiceFlag(t *testing.T) {
	fs := flag.NewFlagSet("dlq list", flag.ContinueOnError)
	fs.SetOutput(io.Discard)
	o := addClientFlags(fs)
	svc := addDLQServiceFlag(fs)
	if err := fs.Parse([]string{"--sender-url", "http://s", "--scheduler-url", "http://c", "--gpuworker-url", "http://g1,http://g2"}); err != nil {
		t.Fatal(err)
	}
	if *svc != "sender" {
		t.Errorf("default --service %q, want sender", *svc)
	}
	for service, want := range map[string]string{"sender": "http://s", "scheduler": "http://c", "gpuworker": "http://g1"} {
		ep, err := dlqEndpoint(o, service)
		if err != nil || ep.url != want {
			t.Errorf("dlqEndpoint(%s) = %+v, %v; want %s", service, ep, err, want)
		}
	}
	if _, err := dlqEndpoint(o, "lookup"); !errors.Is(err, errUsage) {
		t.Errorf("dlqEndpoint(lookup) = %v, want a usage error", err)
	}
}
