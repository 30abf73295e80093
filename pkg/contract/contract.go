// Package contract holds the names that are fixed between kvmesh services and
// the engines that talk to them: Kafka topics, default ports and HTTP routes.
// See docs/contract.md for what each carries.
package contract

// Kafka topics. All are keyed by request id unless noted.
const (
	// TopicEngineSteps carries engine step records (EngineStep) to the
	// scheduler, keyed by engine id.
	TopicEngineSteps = "kvmesh.engine.steps"
	// TopicLookupDecisions carries lookup decisions (a LoadSpec per connector) to the scheduler.
	TopicLookupDecisions = "kvmesh.lookup.decisions"
	// TopicSaveTasks carries save tasks from the scheduler to the sender.
	TopicSaveTasks = "kvmesh.save.tasks"
	// TopicSaveDLQ carries dead-lettered save groups and records to operators.
	TopicSaveDLQ = "kvmesh.save.dlq"
	// TopicLoadTasks carries load tasks from the scheduler to gpuworkers, keyed by engine id.
	TopicLoadTasks = "kvmesh.load.tasks"
	// TopicLoadDLQ carries load-task records a gpuworker could not handle
	// (undecodable, wrong schema) to operators: the original key and a
	// bounded value, with the reason in the headers.
	TopicLoadDLQ = "kvmesh.load.dlq"
	// TopicTransferResults carries save and load outcomes to the scheduler.
	TopicTransferResults = "kvmesh.transfer.results"
	// TopicEngineFeedback carries finished_sending / finished_recving to engines, keyed by engine id.
	TopicEngineFeedback = "kvmesh.engine.feedback"
	// TopicKVEvents carries BlockStored / BlockRemoved events to lookup and routers.
	TopicKVEvents = "kvmesh.kv.events"
)

// Topics lists every contract topic, in a stable order.
var Topics = []string{
	TopicEngineSteps,
	TopicLookupDecisions,
	TopicSaveTasks,
	TopicSaveDLQ,
	TopicLoadTasks,
	TopicLoadDLQ,
	TopicTransferResults,
	TopicEngineFeedback,
	TopicKVEvents,
}

// DefaultPartitions is the partition count of a topic where kvmesh creates
// one: a service that finds a topic missing (KVMESH_KAFKA_PARTITIONS), or
// the dev broker.
const DefaultPartitions = 4

// Default listen addresses of the services.
const (
	LookupAddr    = ":8081"
	SchedulerAddr = ":8082"
	SenderAddr    = ":8083"
	GPUWorkerAddr = ":8084"
	BrokerAddr    = "127.0.0.1:9092"
)

// Trace context and reason headers carried on Kafka records.
const (
	HeaderTraceparent = "traceparent"
	HeaderTracestate  = "tracestate"
	HeaderReason      = "kvmesh-reason"
	HeaderReasonText  = "kvmesh-reason-detail"
	HeaderOrigTopic   = "kvmesh-original-topic"
	HeaderOrigPart    = "kvmesh-original-partition"
	HeaderOrigOffset  = "kvmesh-original-offset"
)
