{{/* The chart's name. */}}
{{- define "kvmesh.name" -}}
{{- default .Chart.Name .Values.nameOverride | trunc 63 | trimSuffix "-" }}
{{- end }}

{{/* The release's full name: the prefix of every object's name. */}}
{{- define "kvmesh.fullname" -}}
{{- if .Values.fullnameOverride }}
{{- .Values.fullnameOverride | trunc 63 | trimSuffix "-" }}
{{- else }}
{{- $name := default .Chart.Name .Values.nameOverride }}
{{- if contains $name .Release.Name }}
{{- .Release.Name | trunc 63 | trimSuffix "-" }}
{{- else }}
{{- printf "%s-%s" .Release.Name $name | trunc 63 | trimSuffix "-" }}
{{- end }}
{{- end }}
{{- end }}

{{/* The image every container runs. */}}
{{- define "kvmesh.image" -}}
{{- printf "%s:%s" .Values.image.repository (default .Chart.AppVersion .Values.image.tag) }}
{{- end }}

{{/* The Secret holding the database and store URLs and the admin token. */}}
{{- define "kvmesh.secretName" -}}
{{- default (include "kvmesh.fullname" .) .Values.existingSecret }}
{{- end }}

{{/* KVMESH_AUTH: auth.mode, required or off (anything else fails the render). */}}
{{- define "kvmesh.authMode" -}}
{{- $mode := "required" }}
{{- with .Values.auth }}{{ $mode = default "required" .mode | toString }}{{ end }}
{{- if not (has $mode (list "required" "off")) }}
{{- fail (printf "auth.mode: %q is neither required nor off" $mode) }}
{{- end }}
{{- $mode }}
{{- end }}

{{/* KVMESH_AUTH_KEY for the chart's Secret: auth.key, required and at least 32 bytes. */}}
{{- define "kvmesh.authKey" -}}
{{- $key := "" }}
{{- with .Values.auth }}{{ $key = default "" .key | toString }}{{ end }}
{{- if not $key }}
{{- fail "auth.key is required with auth.mode=required: set it to a random key of at least 32 bytes (head -c 32 /dev/urandom | base64), or set existingSecret to a Secret holding KVMESH_AUTH_KEY, or set auth.mode=off (development only)" }}
{{- end }}
{{- if lt (len $key) 32 }}
{{- fail (printf "auth.key is %d bytes: it must be at least 32 (head -c 32 /dev/urandom | base64)" (len $key)) }}
{{- end }}
{{- $key }}
{{- end }}

{{/* The HTTP scheme of the services: https with tls.secretName, else http. */}}
{{- define "kvmesh.scheme" -}}
{{- if and .Values.tls .Values.tls.secretName }}https{{ else }}http{{ end }}
{{- end }}

{{/* Where the tls.secretName Secret is mounted. */}}
{{- define "kvmesh.tlsDir" -}}
{{- default "/etc/kvmesh/tls" .Values.tls.mountPath | trimSuffix "/" }}
{{- end }}

{{/* The contract HTTP port of a service (pkg/contract); not configurable. */}}
{{- define "kvmesh.port" -}}
{{- get (dict "lookup" "8081" "scheduler" "8082" "sender" "8083" "gpuworker" "8084") . }}
{{- end }}

{{/* Selector labels; dict: root, component, extra (map, optional). */}}
{{- define "kvmesh.selectorLabels" -}}
app.kubernetes.io/name: {{ include "kvmesh.name" .root }}
app.kubernetes.io/instance: {{ .root.Release.Name }}
app.kubernetes.io/component: {{ .component }}
{{- range $k, $v := .extra }}
{{ $k }}: {{ $v | quote }}
{{- end }}
{{- end }}

{{/* Labels of every object; dict as for kvmesh.selectorLabels. */}}
{{- define "kvmesh.labels" -}}
helm.sh/chart: {{ printf "%s-%s" .root.Chart.Name .root.Chart.Version | replace "+" "_" | trunc 63 | trimSuffix "-" }}
{{ include "kvmesh.selectorLabels" . }}
app.kubernetes.io/part-of: kvmesh
app.kubernetes.io/version: {{ .root.Chart.AppVersion | quote }}
app.kubernetes.io/managed-by: {{ .root.Release.Service }}
{{- end }}

{{/* A value as env text: numbers (which Helm reads as float64) without an exponent. */}}
{{- define "kvmesh.envValue" -}}
{{- if kindIs "float64" . }}
{{- if eq . (floor .) }}{{ int64 . }}{{ else }}{{ . }}{{ end }}
{{- else if kindIs "slice" . }}
{{- join "," . }}
{{- else }}
{{- . }}
{{- end }}
{{- end }}

{{/* A variable from the chart's Secret; dict: root, name, optional. */}}
{{- define "kvmesh.secretEnv" -}}
- name: {{ .name }}
  valueFrom:
    secretKeyRef:
      name: {{ include "kvmesh.secretName" .root }}
      key: {{ .name }}
      {{- if .optional }}
      optional: true
      {{- end }}
{{- end }}

{{/* Settings every service shares. */}}
{{- define "kvmesh.commonEnv" -}}
- name: KVMESH_LOG_LEVEL
  value: {{ .Values.logLevel | quote }}
- name: KVMESH_KAFKA_BROKERS
  value: {{ required "kafka.brokers: at least one broker is required" .Values.kafka.brokers | join "," | quote }}
- name: KVMESH_KAFKA_PARTITIONS
  value: {{ include "kvmesh.envValue" .Values.kafka.partitions | quote }}
{{- with .Values.keyPrefix }}
- name: KVMESH_KEY_PREFIX
  value: {{ . | quote }}
{{- end }}
{{- with .Values.otlpEndpoint }}
- name: OTEL_EXPORTER_OTLP_ENDPOINT
  value: {{ . | quote }}
{{- end }}
{{- if or .Values.existingSecret .Values.adminToken }}
{{ include "kvmesh.secretEnv" (dict "root" . "name" "KVMESH_ADMIN_TOKEN" "optional" (not (empty .Values.existingSecret))) }}
{{- end }}
- name: KVMESH_AUTH
  value: {{ include "kvmesh.authMode" . | quote }}
{{- if eq (include "kvmesh.authMode" .) "required" }}
{{ include "kvmesh.secretEnv" (dict "root" . "name" "KVMESH_AUTH_KEY") }}
{{- end }}
{{- if eq (include "kvmesh.scheme" .) "https" }}
{{- $dir := include "kvmesh.tlsDir" . }}
- name: KVMESH_HTTP_TLS_CERT_FILE
  value: {{ printf "%s/tls.crt" $dir | quote }}
- name: KVMESH_HTTP_TLS_KEY_FILE
  value: {{ printf "%s/tls.key" $dir | quote }}
{{- if .Values.tls.verifyCA }}
- name: KVMESH_HTTP_CA_FILE
  value: {{ printf "%s/ca.crt" $dir | quote }}
{{- end }}
{{- end }}
{{- end }}

{{/*
The models a container serves; dict: root, component, model (a
gpuworker's engine's own model, optional). KVMESH_MODEL is model, or the
engine's model for its gpuworkers; KVMESH_TP/PCP/DCP/PP (parallel) apply
to model only, so a gpuworker of another model runs it at its spec's own
layout, as the services serve it. KVMESH_MODELS (models) is set on the
lookup, the scheduler and the sender, never on a gpuworker: a gpuworker
serves its engine's model alone.
*/}}
{{- define "kvmesh.modelEnv" -}}
{{- $v := .root.Values }}
{{- $default := required "model is required: the mesh's default model (KVMESH_MODEL)" $v.model | toString }}
{{- $model := $default }}
{{- with .model }}{{ $model = toString . }}{{ end }}
- name: KVMESH_MODEL
  value: {{ $model | quote }}
{{- if eq $model $default }}
{{- range $name, $size := dict "KVMESH_TP" $v.parallel.tp "KVMESH_PCP" $v.parallel.pcp "KVMESH_DCP" $v.parallel.dcp "KVMESH_PP" $v.parallel.pp }}
{{- if $size }}
- name: {{ $name }}
  value: {{ include "kvmesh.envValue" $size | quote }}
{{- end }}
{{- end }}
{{- end }}
{{- $models := include "kvmesh.models" .root }}
{{- if and $models (ne .component "gpuworker") }}
- name: KVMESH_MODELS
  value: {{ $models | quote }}
{{- end }}
{{- end }}

{{/*
KVMESH_MODELS: models, comma-separated (empty when none). Each a preset
name or a spec file path, listed once, other than model, without a comma
or a blank.
*/}}
{{- define "kvmesh.models" -}}
{{- $seen := dict }}
{{- $out := list }}
{{- range $i, $m := default list .Values.models }}
{{- $m = toString $m }}
{{- if or (not $m) (regexMatch "[,\\s]" $m) }}
{{- fail (printf "models[%d]: %q is not a preset name or a spec file path (no comma, no blank)" $i $m) }}
{{- end }}
{{- if eq $m (toString $.Values.model) }}
{{- fail (printf "models[%d]: %q is model already, the default model; list only the others" $i $m) }}
{{- end }}
{{- if hasKey $seen $m }}
{{- fail (printf "models: %q is listed twice" $m) }}
{{- end }}
{{- $_ := set $seen $m true }}
{{- $out = append $out $m }}
{{- end }}
{{- join "," $out }}
{{- end }}

{{/* Extra settings of one service (a map), sorted by name. */}}
{{- define "kvmesh.extraEnv" -}}
{{- range $k := keys . | sortAlpha }}
- name: {{ $k }}
  value: {{ include "kvmesh.envValue" (get $ $k) | quote }}
{{- end }}
{{- end }}

{{/*
A Deployment of one kvmesh program; dict:
  root, name, component, program, selector (extra selector labels),
  replicas, recreate (bool), svc (the service's values), env (a YAML list
  of the program's own variables), usesDB (bool), runtimeClassName,
  model (a gpuworker's engine's own model, optional: kvmesh.modelEnv),
  extraPorts (optional list of dicts name, port: more TCP ports the
  program listens on, besides http).
*/}}
{{- define "kvmesh.deployment" -}}
{{- $root := .root -}}
{{- $port := include "kvmesh.port" .component -}}
{{- $labels := dict "root" $root "component" .component "extra" .selector -}}
{{- $scheme := include "kvmesh.scheme" $root -}}
apiVersion: apps/v1
kind: Deployment
metadata:
  name: {{ .name }}
  labels:
    {{- include "kvmesh.labels" $labels | nindent 4 }}
spec:
  replicas: {{ .replicas }}
  {{- if .recreate }}
  # One process per engine id and rank: never two at once.
  strategy:
    type: Recreate
  {{- end }}
  selector:
    matchLabels:
      {{- include "kvmesh.selectorLabels" $labels | nindent 6 }}
  template:
    metadata:
      labels:
        {{- include "kvmesh.labels" $labels | nindent 8 }}
        {{- with $root.Values.podLabels }}
        {{- toYaml . | nindent 8 }}
        {{- end }}
      annotations:
        {{- if not $root.Values.existingSecret }}
        checksum/secret: {{ include (print $root.Template.BasePath "/secret.yaml") $root | sha256sum }}
        {{- end }}
        {{- if has .component (include "kvmesh.tierComponents" $root | splitList ",") }}
        {{- with include "kvmesh.tierSecretData" $root }}
        checksum/tier-secret: {{ . | sha256sum }}
        {{- end }}
        {{- end }}
        {{- with $root.Values.podAnnotations }}
        {{- toYaml . | nindent 8 }}
        {{- end }}
    spec:
      automountServiceAccountToken: false
      {{- with $root.Values.imagePullSecrets }}
      imagePullSecrets:
        {{- toYaml . | nindent 8 }}
      {{- end }}
      {{- with .runtimeClassName }}
      runtimeClassName: {{ . }}
      {{- end }}
      securityContext:
        {{- toYaml $root.Values.podSecurityContext | nindent 8 }}
      {{- if and .usesDB $root.Values.migrate.enabled }}
      initContainers:
        - name: migrate
          image: {{ include "kvmesh.image" $root | quote }}
          imagePullPolicy: {{ $root.Values.image.pullPolicy }}
          command: ["/usr/local/bin/kvmesh", "migrate"]
          env:
            {{- include "kvmesh.secretEnv" (dict "root" $root "name" "KVMESH_DATABASE_URL") | nindent 12 }}
          securityContext:
            {{- toYaml $root.Values.securityContext | nindent 12 }}
          {{- with $root.Values.migrate.resources }}
          resources:
            {{- toYaml . | nindent 12 }}
          {{- end }}
      {{- end }}
      containers:
        - name: {{ .program }}
          image: {{ include "kvmesh.image" $root | quote }}
          imagePullPolicy: {{ $root.Values.image.pullPolicy }}
          command: [{{ printf "/usr/local/bin/%s" .program | quote }}]
          ports:
            - name: http
              containerPort: {{ $port }}
              protocol: TCP
            {{- range .extraPorts }}
            - name: {{ .name }}
              containerPort: {{ .port }}
              protocol: TCP
            {{- end }}
          env:
            {{- include "kvmesh.commonEnv" $root | nindent 12 }}
            {{- include "kvmesh.modelEnv" (dict "root" $root "component" .component "model" .model) | nindent 12 }}
            - name: KVMESH_HTTP_ADDR
              value: {{ printf ":%s" $port | quote }}
            {{- .env | nindent 12 }}
            {{- include "kvmesh.extraEnv" .svc.env | nindent 12 }}
          startupProbe:
            httpGet:
              path: /healthz
              port: http
              scheme: {{ upper $scheme }}
            {{- toYaml $root.Values.probes.startup | nindent 12 }}
          livenessProbe:
            httpGet:
              path: /healthz
              port: http
              scheme: {{ upper $scheme }}
            {{- toYaml $root.Values.probes.liveness | nindent 12 }}
          readinessProbe:
            httpGet:
              path: /readyz
              port: http
              scheme: {{ upper $scheme }}
            {{- toYaml $root.Values.probes.readiness | nindent 12 }}
          securityContext:
            {{- toYaml $root.Values.securityContext | nindent 12 }}
          {{- with .svc.resources }}
          resources:
            {{- toYaml . | nindent 12 }}
          {{- end }}
          volumeMounts:
            - name: tmp
              mountPath: /tmp
            {{- if eq $scheme "https" }}
            - name: tls
              mountPath: {{ include "kvmesh.tlsDir" $root | quote }}
              readOnly: true
            {{- end }}
      volumes:
        - name: tmp
          emptyDir: {}
        {{- if eq $scheme "https" }}
        # The certificate, key and CA of HTTPS (tls.secretName), readable
        # by the pod's group (fsGroup) only.
        - name: tls
          secret:
            secretName: {{ $root.Values.tls.secretName | quote }}
            defaultMode: 0440
        {{- end }}
      {{- with (default $root.Values.nodeSelector .svc.nodeSelector) }}
      nodeSelector:
        {{- toYaml . | nindent 8 }}
      {{- end }}
      {{- with (default $root.Values.tolerations .svc.tolerations) }}
      tolerations:
        {{- toYaml . | nindent 8 }}
      {{- end }}
      {{- with (default $root.Values.affinity .svc.affinity) }}
      affinity:
        {{- toYaml . | nindent 8 }}
      {{- end }}
{{- end }}

{{/* The Service in front of a Deployment; dict: root, name, component, selector, extraPorts (as kvmesh.deployment's). */}}
{{- define "kvmesh.service" -}}
{{- $labels := dict "root" .root "component" .component "extra" .selector -}}
{{- $port := include "kvmesh.port" .component -}}
apiVersion: v1
kind: Service
metadata:
  name: {{ .name }}
  labels:
    {{- include "kvmesh.labels" $labels | nindent 4 }}
  {{- with .root.Values.service.annotations }}
  annotations:
    {{- toYaml . | nindent 4 }}
  {{- end }}
spec:
  type: {{ .root.Values.service.type }}
  selector:
    {{- include "kvmesh.selectorLabels" $labels | nindent 4 }}
  ports:
    - name: http
      port: {{ $port }}
      targetPort: http
      protocol: TCP
    {{- range .extraPorts }}
    - name: {{ .name }}
      port: {{ .port }}
      targetPort: {{ .name }}
      protocol: TCP
    {{- end }}
{{- end }}

{{/* The capacity tier is on: "true" with tier.enabled, else empty. */}}
{{- define "kvmesh.tierEnabled" -}}
{{- if and .Values.tier .Values.tier.enabled }}true{{ end }}
{{- end }}

{{/* The in-chart S3 server runs: "true" with tier.enabled and tier.server.enabled. */}}
{{- define "kvmesh.tierServer" -}}
{{- if and (include "kvmesh.tierEnabled" .) .Values.tier.server .Values.tier.server.enabled }}true{{ end }}
{{- end }}

{{/* The name of the tier's objects: its Secret and the server's Deployment, Service and claim. */}}
{{- define "kvmesh.tierName" -}}
{{- printf "%s-tier" (include "kvmesh.fullname" .) | trunc 63 | trimSuffix "-" }}
{{- end }}

{{/* The S3 API port of the in-chart server. */}}
{{- define "kvmesh.tierPort" -}}7070{{- end }}

{{/* The bucket the in-chart server makes: tier.server.bucket, an S3 bucket name. */}}
{{- define "kvmesh.tierBucket" -}}
{{- $b := default "kvmesh" .Values.tier.server.bucket | toString }}
{{- if not (regexMatch "^[a-z0-9][a-z0-9.-]{1,61}[a-z0-9]$" $b) }}
{{- fail (printf "tier.server.bucket: %q is not an S3 bucket name (3 to 63 of a-z, 0-9, '.' and '-', a letter or digit at each end)" $b) }}
{{- end }}
{{- $b }}
{{- end }}

{{/*
KVMESH_TIER_URL: tier.url, else the in-chart server's bucket; a path-style
http(s) URL naming a bucket (anything else fails the render).
*/}}
{{- define "kvmesh.tierURL" -}}
{{- $url := default "" .Values.tier.url | toString }}
{{- if and (not $url) (include "kvmesh.tierServer" .) }}
{{- $url = printf "http://%s.%s.svc:%s/%s" (include "kvmesh.tierName" .) .Release.Namespace (include "kvmesh.tierPort" .) (include "kvmesh.tierBucket" .) }}
{{- end }}
{{- if not $url }}
{{- fail "tier.url is required with tier.enabled: the S3 API URL and bucket, http(s)://host:port/bucket[/prefix] (or set tier.server.enabled to run an S3 server in the release)" }}
{{- end }}
{{- if not (regexMatch "^https?://[^/?#@\\s]+/[^/?#\\s]+(/[^?#\\s]*)?$" $url) }}
{{- fail (printf "tier.url: %q is not http(s)://host[:port]/bucket[/prefix] (path-style, no credentials or query: the keys go in tier.accessKey and tier.secretKey or tier.existingSecret)" $url) }}
{{- end }}
{{- $url }}
{{- end }}

{{/*
The Secret holding the tier's credentials under the keys accessKey and
secretKey: tier.existingSecret, else the chart's when tier.accessKey and
tier.secretKey are set; empty when there are none (unsigned requests).
*/}}
{{- define "kvmesh.tierSecretName" -}}
{{- $t := .Values.tier }}
{{- if $t.existingSecret }}
{{- $t.existingSecret }}
{{- else }}
{{- if or (and $t.accessKey (not $t.secretKey)) (and $t.secretKey (not $t.accessKey)) }}
{{- fail "tier.accessKey and tier.secretKey: set both (or neither, or tier.existingSecret)" }}
{{- end }}
{{- if $t.accessKey }}{{ include "kvmesh.tierName" . }}{{ end }}
{{- end }}
{{- end }}

{{/* The data of the chart's tier Secret; empty when the chart makes none. */}}
{{- define "kvmesh.tierSecretData" -}}
{{- if and (include "kvmesh.tierEnabled" .) (not .Values.tier.existingSecret) (include "kvmesh.tierSecretName" .) }}
accessKey: {{ .Values.tier.accessKey | toString | quote }}
secretKey: {{ .Values.tier.secretKey | toString | quote }}
{{- end }}
{{- end }}

{{/* A variable from the tier's Secret; dict: root, name, key. */}}
{{- define "kvmesh.tierSecretEnv" -}}
- name: {{ .name }}
  valueFrom:
    secretKeyRef:
      name: {{ include "kvmesh.tierSecretName" .root }}
      key: {{ .key }}
{{- end }}

{{/* The components that read the tier's settings (service.Tier in their Config). */}}
{{- define "kvmesh.tierComponents" -}}lookup,gpuworker{{- end }}

{{/*
The tier's settings of the lookup and the gpuworkers (empty with the tier
off): the URL, the credentials from the tier's Secret, and the region,
queue and timeout when set.
*/}}
{{- define "kvmesh.tierEnv" -}}
{{- if include "kvmesh.tierEnabled" . }}
{{- $t := .Values.tier }}
{{- if and (include "kvmesh.tierServer" .) (not (include "kvmesh.tierSecretName" .)) }}
{{- fail "tier.server.enabled needs the server's root credentials: set tier.accessKey and tier.secretKey, or tier.existingSecret" }}
{{- end }}
- name: KVMESH_TIER_URL
  value: {{ include "kvmesh.tierURL" . | quote }}
{{- if include "kvmesh.tierSecretName" . }}
{{ include "kvmesh.tierSecretEnv" (dict "root" . "name" "KVMESH_TIER_ACCESS_KEY" "key" "accessKey") }}
{{ include "kvmesh.tierSecretEnv" (dict "root" . "name" "KVMESH_TIER_SECRET_KEY" "key" "secretKey") }}
{{- end }}
{{- with $t.region }}
- name: KVMESH_TIER_REGION
  value: {{ . | toString | quote }}
{{- end }}
{{- with $t.queueBytes }}
- name: KVMESH_TIER_QUEUE_BYTES
  value: {{ include "kvmesh.envValue" . | quote }}
{{- end }}
{{- with $t.timeout }}
- name: KVMESH_TIER_TIMEOUT
  value: {{ . | toString | quote }}
{{- end }}
{{- end }}
{{- end }}

{{/* Selector labels of the in-chart S3 server. */}}
{{- define "kvmesh.tierSelectorLabels" -}}
app.kubernetes.io/name: versitygw
app.kubernetes.io/instance: {{ .Release.Name }}
app.kubernetes.io/component: tier
{{- end }}

{{/*
Labels of the in-chart S3 server's objects: not the mesh's name, so that
neither the ServiceMonitor (versitygw serves no /metrics) nor a kvmesh
Service selects them.
*/}}
{{- define "kvmesh.tierLabels" -}}
helm.sh/chart: {{ printf "%s-%s" .Chart.Name .Chart.Version | replace "+" "_" | trunc 63 | trimSuffix "-" }}
{{ include "kvmesh.tierSelectorLabels" . }}
app.kubernetes.io/part-of: kvmesh
app.kubernetes.io/version: {{ .Values.tier.server.image.tag | toString | quote }}
app.kubernetes.io/managed-by: {{ .Release.Service }}
{{- end }}

{{/* The form of the events the sender and the gpuworkers write to
kvmesh.kv.events (KVMESH_KV_EVENTS_FORM): map or array. */}}
{{- define "kvmesh.kvEventsEnv" -}}
{{- $f := .Values.kvEventsForm | default "map" -}}
{{- if not (has $f (list "map" "array")) -}}
{{- fail (printf "kvEventsForm: %q is not map or array" $f) -}}
{{- end -}}
- name: KVMESH_KV_EVENTS_FORM
  value: {{ $f | quote }}
{{- end }}
