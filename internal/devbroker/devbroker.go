// Package devbroker runs kvmesh's embedded Kafka-protocol broker: franz-go's
// kfake, bound to the loopback interface, speaking the real Kafka protocol over
// TCP, with every contract topic created before Start returns.
//
// It serves `make run`, `kvmesh devbroker` and the tests; production uses a
// real Kafka cluster. It can require TLS (Config.TLS, mutual TLS with a
// client CA) and SASL authentication (Config.SASLUsers: PLAIN,
// SCRAM-SHA-256 and SCRAM-SHA-512), so that clients' security settings can
// be tried against a real broker. kfake keeps every record in memory (about 1 GB per 1.3M
// small records), so it suits development volumes only.
package devbroker

import (
	"context"
	"crypto/tls"
	"errors"
	"fmt"
	"net"
	"regexp"
	"slices"
	"strconv"
	"time"

	"github.com/segmentio/kafka-go"
	"github.com/twmb/franz-go/pkg/kerr"
	"github.com/twmb/franz-go/pkg/kfake"

	"github.com/kvmesh/kvmesh/pkg/contract"
	"github.com/kvmesh/kvmesh/pkg/tlsfiles"
)

// DefaultPartitions is the partition count of each topic unless configured:
// the contract's.
const DefaultPartitions = contract.DefaultPartitions

// maxPartitions bounds Config.Partitions: kfake keeps every partition in RAM.
const maxPartitions = 1024

// clusterID is the cluster id the broker reports in metadata responses.
const clusterID = "kvmesh-dev"

// Sentinel errors.
var (
	// ErrInvalidConfig reports a Config that Validate rejects.
	ErrInvalidConfig = errors.New("devbroker: invalid config")
)

// topicName matches the names Kafka accepts for topics.
var topicName = regexp.MustCompile(`^[a-zA-Z0-9._-]{1,249}$`)

// Config configures the embedded broker. The zero value is usable: every
// field has a default.
type Config struct {
	// Addr is the host:port to listen on; the host must be loopback
	// (127.0.0.1, localhost or empty) because kfake binds 127.0.0.1 only.
	// Port 0 picks a free port. Default contract.BrokerAddr (127.0.0.1:9092).
	Addr string
	// Partitions is the partition count of the topics Start creates and of
	// auto-created topics. Default DefaultPartitions.
	Partitions int
	// DataDir, when set, persists topics, records and committed offsets in
	// this directory across restarts. Empty keeps everything in memory.
	DataDir string
	// Topics are created at start when missing. Default contract.Topics.
	Topics []string
	// GroupMinSessionTimeout lowers the smallest consumer-group session
	// timeout the broker accepts (kfake's default is 6 s). Tests lower it so
	// that groups rebalance quickly. Zero keeps the default.
	GroupMinSessionTimeout time.Duration
	// SASLUsers, when set, makes every client authenticate with SASL as one
	// of them before any other request; each is a kfake superuser, allowed
	// everything. Empty accepts clients without SASL.
	SASLUsers []SASLUser
	// TLS, when TLS.CertFile is set, makes the broker accept TLS connections
	// only, presenting TLS.CertFile and TLS.KeyFile; with TLS.CAFile set as
	// well every client must present a certificate TLS.CAFile verifies
	// (mutual TLS). TLS.ServerName is unused. Zero listens in plaintext.
	TLS tlsfiles.Files
}

// withDefaults returns c with every unset field given its default.
func (c Config) withDefaults() Config {
	if c.Addr == "" {
		c.Addr = contract.BrokerAddr
	}
	if c.Partitions == 0 {
		c.Partitions = DefaultPartitions
	}
	if len(c.Topics) == 0 {
		c.Topics = slices.Clone(contract.Topics)
	}
	return c
}

// Validate reports whether c can start a broker. Unset fields are valid:
// they take their defaults.
func (c Config) Validate() error {
	c = c.withDefaults()
	if _, err := listenPort(c.Addr); err != nil {
		return err
	}
	if c.Partitions < 1 || c.Partitions > maxPartitions {
		return fmt.Errorf("%w: partitions %d not in [1, %d]", ErrInvalidConfig, c.Partitions, maxPartitions)
	}
	for _, t := range c.Topics {
		if !topicName.MatchString(t) || t == "." || t == ".." {
			return fmt.Errorf("%w: topic name %q", ErrInvalidConfig, t)
		}
	}
	if c.GroupMinSessionTimeout < 0 {
		return fmt.Errorf("%w: negative group min session timeout", ErrInvalidConfig)
	}
	if err := validateUsers(c.SASLUsers); err != nil {
		return err
	}
	_, err := c.serverTLS()
	return err
}

// listenPort checks that addr is a loopback host:port and returns the port.
func listenPort(addr string) (int, error) {
	host, portText, err := net.SplitHostPort(addr)
	if err != nil {
		return 0, fmt.Errorf("%w: addr %q: %w", ErrInvalidConfig, addr, err)
	}
	if host != "" && host != "127.0.0.1" && host != "localhost" {
		return 0, fmt.Errorf("%w: addr %q: host must be 127.0.0.1 or localhost", ErrInvalidConfig, addr)
	}
	port, err := strconv.Atoi(portText)
	if err != nil || port < 0 || port > 65535 {
		return 0, fmt.Errorf("%w: addr %q: bad port", ErrInvalidConfig, addr)
	}
	return port, nil
}

// Broker is a running embedded broker.
type Broker struct {
	cluster *kfake.Cluster
	addrs   []string
	topics  []string
}

// Start starts the broker, creates every configured topic that does not exist
// yet (topics restored from DataDir are kept as they are) and returns once a
// Kafka client can see all of them. Auto topic creation is allowed. ctx bounds
// only the start; the broker runs until Close.
func Start(ctx context.Context, cfg Config) (*Broker, error) {
	if err := cfg.Validate(); err != nil {
		return nil, err
	}
	cfg = cfg.withDefaults()
	port, err := listenPort(cfg.Addr)
	if err != nil {
		return nil, err
	}
	tc, err := cfg.serverTLS()
	if err != nil {
		return nil, err
	}
	cluster, err := kfake.NewCluster(clusterOptions(cfg, port, tc)...)
	if err != nil {
		return nil, fmt.Errorf("devbroker: start: %w", err)
	}
	b := &Broker{cluster: cluster, addrs: cluster.ListenAddrs(), topics: slices.Clone(cfg.Topics)}
	if err := b.createTopics(cfg.Topics, cfg.Partitions); err != nil {
		b.Close()
		return nil, err
	}
	if err := b.waitTopics(ctx, cfg, tc); err != nil {
		b.Close()
		return nil, err
	}
	return b, nil
}

// clusterOptions translates a defaulted, valid Config into kfake options
// for one broker listening on port, with tc (nil: plaintext).
func clusterOptions(cfg Config, port int, tc *tls.Config) []kfake.Opt {
	opts := []kfake.Opt{
		kfake.Ports(port),
		kfake.ClusterID(clusterID),
		kfake.DefaultNumPartitions(cfg.Partitions),
		kfake.AllowAutoTopicCreation(),
	}
	if cfg.DataDir != "" {
		opts = append(opts, kfake.DataDir(cfg.DataDir))
	}
	if cfg.GroupMinSessionTimeout > 0 {
		opts = append(opts, kfake.GroupMinSessionTimeout(cfg.GroupMinSessionTimeout))
	}
	if len(cfg.SASLUsers) > 0 {
		opts = append(opts, kfake.EnableSASL())
		for _, u := range cfg.SASLUsers {
			opts = append(opts, kfake.Superuser(u.Mechanism.KafkaName(), u.Name, u.Password))
		}
	}
	if tc != nil {
		opts = append(opts, kfake.TLS(tc))
	}
	return opts
}

// createTopics creates each missing topic in process, on the cluster itself,
// which avoids the "Not Controller" error of a CreateTopics sent to the
// wrong node.
func (b *Broker) createTopics(topics []string, partitions int) error {
	for _, t := range topics {
		if b.cluster.TopicInfo(t) != nil {
			continue
		}
		err := b.cluster.CreateTopic(t, int32(partitions), nil)
		if err != nil && !errors.Is(err, kerr.TopicAlreadyExists) {
			return fmt.Errorf("devbroker: create topic %s: %w", t, err)
		}
	}
	return nil
}

// waitTopics asks the broker for metadata over TCP, as any client would
// (over TLS trusting the broker's own certificate, authenticated as the
// first SASL user), and polls until every topic has partitions with leaders
// or ctx ends. With mutual TLS, which it has no client certificate for, it
// polls the cluster in process instead.
func (b *Broker) waitTopics(ctx context.Context, cfg Config, tc *tls.Config) error {
	ready := func() error { return b.topicsCreated(cfg.Topics) }
	if tc == nil || tc.ClientAuth != tls.RequireAndVerifyClientCert {
		transport, err := selfTransport(cfg, tc)
		if err != nil {
			return err
		}
		defer transport.CloseIdleConnections()
		client := &kafka.Client{Addr: kafka.TCP(b.addrs...), Transport: transport, Timeout: 5 * time.Second}
		ready = func() error { return topicsReady(ctx, client, cfg.Topics) }
	}
	tick := time.NewTicker(20 * time.Millisecond)
	defer tick.Stop()
	for {
		err := ready()
		if err == nil {
			return nil
		}
		select {
		case <-ctx.Done():
			return fmt.Errorf("devbroker: waiting for topics: %w (last: %w)", ctx.Err(), err)
		case <-tick.C:
		}
	}
}

// topicsCreated reports whether the cluster holds every topic.
func (b *Broker) topicsCreated(topics []string) error {
	for _, t := range topics {
		if b.cluster.TopicInfo(t) == nil {
			return fmt.Errorf("topic %s not created", t)
		}
	}
	return nil
}

// topicsReady reports whether metadata lists every topic with partitions.
func topicsReady(ctx context.Context, client *kafka.Client, topics []string) error {
	md, err := client.Metadata(ctx, &kafka.MetadataRequest{Topics: topics})
	if err != nil {
		return err
	}
	seen := make(map[string]bool, len(md.Topics))
	for _, t := range md.Topics {
		if t.Error == nil && len(t.Partitions) > 0 {
			seen[t.Name] = true
		}
	}
	for _, t := range topics {
		if !seen[t] {
			return fmt.Errorf("topic %s not ready", t)
		}
	}
	return nil
}

// Addrs returns the host:port addresses clients bootstrap from.
func (b *Broker) Addrs() []string {
	return slices.Clone(b.addrs)
}

// Topics returns the topics Start ensured.
func (b *Broker) Topics() []string {
	return slices.Clone(b.topics)
}

// Cluster returns the underlying kfake cluster, for tests that inspect
// groups, partitions or inject faults.
func (b *Broker) Cluster() *kfake.Cluster {
	return b.cluster
}

// Close stops the broker; with a DataDir it first saves its state. It is safe
// to call more than once.
func (b *Broker) Close() {
	b.cluster.Close()
}
