// Command fakeservice stands in for a kvmesh service in the tests of
// testenv.Procs: it serves GET /healthz, GET /readyz and GET /env?name=N
// (the value of variable N) on KVMESH_HTTP_ADDR until SIGTERM.
//
// FAKESERVICE_EXIT=msg makes it print msg and exit 3 at once;
// FAKESERVICE_UNREADY=n makes its first n answers to /readyz 503.
package main

import (
	"context"
	"errors"
	"fmt"
	"net"
	"net/http"
	"os"
	"os/signal"
	"strconv"
	"sync/atomic"
	"syscall"
)

func main() {
	if msg := os.Getenv("FAKESERVICE_EXIT"); msg != "" {
		fmt.Fprintln(os.Stderr, msg)
		os.Exit(3)
	}
	if err := serve(); err != nil {
		fmt.Fprintln(os.Stderr, err)
		os.Exit(1)
	}
	fmt.Println("stopped by SIGTERM")
}

func serve() error {
	unready, _ := strconv.ParseInt(os.Getenv("FAKESERVICE_UNREADY"), 10, 64) // unset: 0
	var readyzCalls atomic.Int64
	mux := http.NewServeMux()
	mux.HandleFunc("GET /healthz", func(http.ResponseWriter, *http.Request) {})
	mux.HandleFunc("GET /readyz", func(w http.ResponseWriter, _ *http.Request) {
		if readyzCalls.Add(1) <= unready {
			w.WriteHeader(http.StatusServiceUnavailable)
		}
	})
	mux.HandleFunc("GET /env", func(w http.ResponseWriter, r *http.Request) {
		fmt.Fprint(w, os.Getenv(r.URL.Query().Get("name")))
	})
	l, err := net.Listen("tcp", os.Getenv("KVMESH_HTTP_ADDR"))
	if err != nil {
		return err
	}
	fmt.Println("listening on", l.Addr())
	srv := &http.Server{Handler: mux}
	ctx, stop := signal.NotifyContext(context.Background(), syscall.SIGTERM)
	defer stop()
	go func() {
		<-ctx.Done()
		_ = srv.Shutdown(context.Background()) // Serve then returns ErrServerClosed
	}()
	if err := srv.Serve(l); !errors.Is(err, http.ErrServerClosed) {
		return err
	}
	return nil
}
