package testenv

import (
	"context"
	"errors"
	"net"
	"sync"
	"testing"
	"time"
)

// DelayProxy is a TCP proxy on a loopback port of its own in front of one
// target address, which a test makes slow (SetDelay) or takes down
// (SetDown) while the target itself keeps running: a server that answers
// late, or one that is gone, as its clients see it.
type DelayProxy struct {
	t      testing.TB
	target string
	addr   string

	mu     sync.Mutex
	delay  time.Duration
	down   bool
	closed bool
	ln     net.Listener
	conns  map[*proxyConn]struct{}
	wg     sync.WaitGroup // the accept loop and the connections' goroutines
}

// proxyConn is one client connection and the one to the target it is
// forwarded to.
type proxyConn struct {
	client net.Conn
	cut    chan struct{} // closed when the connection is cut
	once   sync.Once

	mu     sync.Mutex
	server net.Conn // nil until dialled
}

// proxyBuffer is the most one read forwards at once (one chunk).
const proxyBuffer = 32 << 10

// proxyDialTimeout bounds the dial of the target for each connection.
const proxyDialTimeout = 5 * time.Second

// StartDelayProxy listens on a free 127.0.0.1 port and forwards every
// connection to target (host:port), dialled when the connection is
// accepted. It closes when the test ends.
func StartDelayProxy(t testing.TB, target string) *DelayProxy {
	t.Helper()
	ln, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		t.Fatalf("delay proxy: %v", err)
	}
	addr := ln.Addr().(*net.TCPAddr)
	// freeAddr must not hand this port out while the proxy is down.
	handedOut.Lock()
	handedOut.ports[addr.Port] = true
	handedOut.Unlock()
	p := &DelayProxy{t: t, target: target, addr: addr.String(), ln: ln, conns: map[*proxyConn]struct{}{}}
	p.serve(ln)
	t.Cleanup(p.Close)
	return p
}

// Addr returns the proxy's host:port, for the clients in place of target's.
func (p *DelayProxy) Addr() string { return p.addr }

// SetDelay makes every chunk of bytes (up to 32 KiB, as one read returns
// them) that the proxy reads from either side wait d before it is written
// to the other side, from the next chunk on: a request and its answer take
// at least 2d longer, a body of many chunks longer still. Zero forwards at
// once.
func (p *DelayProxy) SetDelay(d time.Duration) {
	p.mu.Lock()
	p.delay = d
	p.mu.Unlock()
}

// SetDown(true) takes the proxy down: it stops listening (a new connection
// is refused) and cuts every connection it forwards (their clients read
// EOF or a reset); SetDown(false) listens again on the same address.
func (p *DelayProxy) SetDown(down bool) {
	p.mu.Lock()
	defer p.mu.Unlock()
	if p.closed || down == p.down {
		return
	}
	p.down = down
	if down {
		p.ln.Close()
		for c := range p.conns {
			c.close()
		}
		return
	}
	ln, err := net.Listen("tcp", p.addr)
	if err != nil {
		// Someone took the port meanwhile; the proxy stays down.
		p.down = true
		p.t.Errorf("delay proxy: listen again on %s: %v", p.addr, err)
		return
	}
	p.ln = ln
	p.serve(ln)
}

// Close stops the proxy, cuts its connections and waits for its
// goroutines. It runs when the test ends; later calls do nothing.
func (p *DelayProxy) Close() {
	p.mu.Lock()
	if !p.closed {
		p.closed = true
		p.ln.Close()
		for c := range p.conns {
			c.close()
		}
	}
	p.mu.Unlock()
	p.wg.Wait()
}

// serve accepts on ln until it is closed. Called with p.mu held (or before
// p is shared).
func (p *DelayProxy) serve(ln net.Listener) {
	p.wg.Add(1)
	go func() {
		defer p.wg.Done()
		for {
			c, err := ln.Accept()
			if err != nil {
				if errors.Is(err, net.ErrClosed) {
					return
				}
				// A connection that failed before it was accepted, or
				// out of descriptors: try again shortly.
				time.Sleep(10 * time.Millisecond)
				continue
			}
			p.mu.Lock()
			if p.down || p.closed {
				p.mu.Unlock()
				c.Close()
				continue
			}
			pc := &proxyConn{client: c, cut: make(chan struct{})}
			p.conns[pc] = struct{}{}
			p.wg.Add(1)
			p.mu.Unlock()
			go p.forward(pc)
		}
	}()
}

// forward dials the target for pc and copies both ways until either side
// ends or pc is cut.
func (p *DelayProxy) forward(pc *proxyConn) {
	defer p.wg.Done()
	defer func() {
		pc.close()
		p.mu.Lock()
		delete(p.conns, pc)
		p.mu.Unlock()
	}()
	ctx, cancel := context.WithTimeout(context.Background(), proxyDialTimeout)
	go func() {
		select {
		case <-pc.cut:
			cancel()
		case <-ctx.Done():
		}
	}()
	var d net.Dialer
	server, err := d.DialContext(ctx, "tcp", p.target)
	cancel()
	if err != nil {
		return // the target is not there: the client reads EOF
	}
	pc.mu.Lock()
	pc.server = server
	pc.mu.Unlock()
	select {
	case <-pc.cut: // cut while dialling: close() did not see server
		server.Close()
		return
	default:
	}
	done := make(chan struct{}, 2)
	go func() { p.pump(pc, server, pc.client); done <- struct{}{} }()
	go func() { p.pump(pc, pc.client, server); done <- struct{}{} }()
	<-done
	<-done
}

// pump copies src to dst, each chunk after the delay in force when it was
// read; at src's end it half-closes dst, so that a client's EOF reaches the
// target and the target's the client.
func (p *DelayProxy) pump(pc *proxyConn, dst, src net.Conn) {
	buf := make([]byte, proxyBuffer)
	for {
		n, err := src.Read(buf)
		if n > 0 {
			p.mu.Lock()
			d := p.delay
			p.mu.Unlock()
			if d > 0 {
				timer := time.NewTimer(d)
				select {
				case <-timer.C:
				case <-pc.cut:
					timer.Stop()
					return
				}
			}
			if _, werr := dst.Write(buf[:n]); werr != nil {
				pc.close()
				return
			}
		}
		if err != nil {
			if tc, ok := dst.(*net.TCPConn); ok {
				_ = tc.CloseWrite()
			}
			return
		}
	}
}

// close cuts the connection: both sides are closed and any delayed chunk
// dropped.
func (c *proxyConn) close() {
	c.once.Do(func() {
		close(c.cut)
		c.client.Close()
		c.mu.Lock()
		if c.server != nil {
			c.server.Close()
		}
		c.mu.Unlock()
	})
}
