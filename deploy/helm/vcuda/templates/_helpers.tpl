{{/*
Labels on every object besides its own app.kubernetes.io/name (kept as
deploy/ has it): which release and chart made it. Never in selectors or pod
templates (those are deploy/'s, so a kustomize install can be taken over).
*/}}
{{- define "vcuda.labels" -}}
helm.sh/chart: {{ printf "%s-%s" .Chart.Name .Chart.Version | replace "+" "_" | trunc 63 | trimSuffix "-" }}
app.kubernetes.io/managed-by: {{ .Release.Service }}
app.kubernetes.io/instance: {{ .Release.Name }}
app.kubernetes.io/part-of: vcuda
{{- with .Chart.AppVersion }}
app.kubernetes.io/version: {{ . | quote }}
{{- end }}
{{- end }}

{{/* metadata.labels of an object named app.kubernetes.io/name=<name>. */}}
{{- define "vcuda.labelsFor" -}}
app.kubernetes.io/name: {{ .name }}
{{ include "vcuda.labels" .root }}
{{- end }}

{{- define "vcuda.image" -}}
{{ .Values.image.repository }}:{{ .Values.image.tag | default .Chart.AppVersion }}
{{- end }}

{{- define "vcuda.pullSecrets" -}}
{{- with .Values.image.pullSecrets }}
imagePullSecrets:
{{- range . }}
  - name: {{ . }}
{{- end }}
{{- end }}
{{- end }}

{{/*
Values the schema cannot express, each failing with what to change.
*/}}
{{- define "vcuda.validate" -}}
{{- if ne .Values.resourceCores "tencent.com/vcuda-core" }}
{{- fail (printf "resourceCores: %q is not served: gpu-manager registers tencent.com/vcuda-core (fixed in this release)" .Values.resourceCores) }}
{{- end }}
{{- if ne .Values.resourceMem "tencent.com/vcuda-memory" }}
{{- fail (printf "resourceMem: %q is not served: gpu-manager registers tencent.com/vcuda-memory (fixed in this release)" .Values.resourceMem) }}
{{- end }}
{{- if ne .Values.memoryUnit "256Mi" }}
{{- fail (printf "memoryUnit: %q: one tencent.com/vcuda-memory is 256Mi (fixed in this release)" .Values.memoryUnit) }}
{{- end }}
{{- if and (eq .Values.mode "dra") (not .Values.uninstall.enabled) (semverCompare "<1.34.0-0" .Capabilities.KubeVersion.Version) }}
{{- fail (printf "mode: dra needs Kubernetes >= 1.34 (resource.k8s.io/v1); this cluster is %s (helm template: --kube-version)" .Capabilities.KubeVersion.Version) }}
{{- end }}
{{- if and .Values.scheduler.enabled (eq .Values.mode "dra") }}
{{- fail "scheduler.enabled: the extender places device-plugin pods; in mode dra the scheduler allocates claims itself (docs/scheduler.md)" }}
{{- end }}
{{- $c := fromYaml (include "vcuda.config" .) }}
{{- $q := toString (index $c "query-addr" | default "127.0.0.1") }}
{{- if or (hasPrefix "127." $q) (eq $q "localhost") (eq $q "::1") }}
{{- if not (hasKey $c "health-port") }}
{{- fail (printf "config.health-port: query-addr %q is inside the pod, where the kubelet's probes cannot reach it; give the probes a port of their own (health-port, on metrics-addr)" $q) }}
{{- end }}
{{- if not (hasKey $c "metrics-port") }}
{{- fail (printf "config.metrics-port: query-addr %q is inside the pod, where Prometheus cannot reach it; give the metrics a port of their own (metrics-port, on metrics-addr)" $q) }}
{{- end }}
{{- end }}
{{- end }}

{{/* The port Prometheus scrapes: metrics-port, else the query port. */}}
{{- define "vcuda.metricsPort" -}}
{{- $c := fromYaml (include "vcuda.config" .) }}
{{- index $c "metrics-port" | default (index $c "query-port") }}
{{- end }}

{{/*
The port the kubelet probes: health (health-port), else the query port,
named metrics where it serves Prometheus too.
*/}}
{{- define "vcuda.probePort" -}}
{{- $c := fromYaml (include "vcuda.config" .) }}
{{- if hasKey $c "health-port" }}health
{{- else if not (hasKey $c "metrics-port") }}metrics
{{- else }}{{ index $c "query-port" }}
{{- end }}
{{- end }}

{{/* One TOML value: bool, integer, string or a list of them. */}}
{{- define "vcuda.tomlValue" -}}
{{- if kindIs "bool" . -}}
{{ . }}
{{- else if or (kindIs "float64" .) (kindIs "int" .) (kindIs "int64" .) -}}
{{ int64 . }}
{{- else if kindIs "slice" . -}}
[{{ range $i, $e := . }}{{ if $i }}, {{ end }}{{ include "vcuda.tomlValue" $e }}{{ end }}]
{{- else -}}
{{ toJson (toString .) }}
{{- end -}}
{{- end }}

{{/* A flat table of the manager's settings as TOML, keys sorted. */}}
{{- define "vcuda.toml" -}}
{{- range $k := keys . | sortAlpha }}
{{ $k }} = {{ include "vcuda.tomlValue" (index $ $k) }}
{{- end }}
{{- end }}

{{/* The settings every node starts from: share-mode, then .Values.config. */}}
{{- define "vcuda.config" -}}
{{- toYaml (merge (deepCopy .Values.config) (dict "share-mode" true)) }}
{{- end }}

{{- define "vcuda.configDir" -}}
/etc/gpu-manager/config
{{- end }}

{{/*
Container command and args of a node daemon (gpu-manager or
vcuda-dra-driver): .binary, .configFlag, .args (after the config flag).
Without nodeConfig the config flag is an argument, as deploy/ has it; with
it, a shell picks node-$NODE_NAME.toml when the ConfigMap has one.
*/}}
{{- define "vcuda.daemonCommand" -}}
{{- $dir := include "vcuda.configDir" .root }}
{{- if .root.Values.nodeConfig }}
command:
  - /bin/sh
  - -c
  - >-
    c={{ $dir }}/node-$NODE_NAME.toml;
    [ -f "$c" ] || c={{ $dir }}/gpu-manager.toml;
    exec {{ .binary }} "{{ .configFlag }}=$c" "$@"
  - {{ base .binary }}
{{- else if .command }}
command: [{{ .binary | quote }}]
{{- end }}
args:
{{- if not .root.Values.nodeConfig }}
  - {{ .configFlag }}={{ $dir }}/gpu-manager.toml
{{- end }}
{{- range .args }}
  - {{ . | quote }}
{{- end }}
{{- end }}

{{/* checksum/config: a changed ConfigMap rolls the daemons. */}}
{{- define "vcuda.configChecksum" -}}
checksum/config: {{ include (print .Template.BasePath "/config.yaml") . | sha256sum }}
{{- end }}

{{/* The parents of the paths .keys of the settings, distinct, in order (JSON). */}}
{{- define "vcuda.stateParents" -}}
{{- $c := fromYaml (include "vcuda.config" .) }}
{{- $out := list }}
{{- range $k := .keys }}
{{- $out = append $out (dir (index $c $k)) }}
{{- end }}
{{- toJson (uniq $out) }}
{{- end }}
