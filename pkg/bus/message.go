// Package bus is kvmesh's Kafka layer on segmentio/kafka-go: a producer with
// trace-context injection and a consumer-group loop that classifies handler
// errors, retries transient ones, dead-letters permanent ones and commits only
// after a handler's effects are durable.
package bus

import "github.com/kvmesh/kvmesh/pkg/contract"

// Message is one record to publish or one record received.
type Message struct {
	// Topic is the Kafka topic.
	Topic string
	// Key is the partitioning key: the entity whose order matters.
	Key string
	// Value is the encoded payload (JSON with a "schema" field in kvmesh).
	Value []byte
	// Headers are record headers; trace context lives here.
	Headers map[string]string
}

// KVEventMessage is r as its record on contract.TopicKVEvents
// (contract.EncodeKVEventRecord: vLLM's KVEventBatch in form as the value,
// kvmesh's fields in headers, keyed by store namespace).
func KVEventMessage(r contract.KVEventRecord, form contract.KVEventForm) (Message, error) {
	key, value, headers, err := contract.EncodeKVEventRecord(r, form)
	if err != nil {
		return Message{}, err
	}
	return Message{Topic: contract.TopicKVEvents, Key: key, Value: value, Headers: headers}, nil
}
