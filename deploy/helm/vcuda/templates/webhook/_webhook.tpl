{{/*
vcuda-webhook's helpers (templates/webhook/: the admission webhook, apart
from the rest of the chart).
*/}}
{{- define "vcuda.webhook.name" -}}
vcuda-webhook
{{- end }}

{{- define "vcuda.webhook.secretName" -}}
vcuda-webhook-tls
{{- end }}

{{/* --mode of the binary. */}}
{{- define "vcuda.webhook.mode" -}}
{{- ternary "dra" "device-plugin" (eq .Values.mode "dra") }}
{{- end }}

{{/* Whether /mutate is registered: a scheduler name to inject, or DRA rewrites. */}}
{{- define "vcuda.webhook.mutates" -}}
{{- if or .Values.webhook.schedulerName (and (eq .Values.mode "dra") .Values.webhook.draRewrite) }}true{{ end }}
{{- end }}

{{- define "vcuda.webhook.enabled" -}}
{{- if and .Values.webhook.enabled (not .Values.uninstall.enabled) }}true{{ end }}
{{- end }}

{{/*
--trusted-user: who may write pods' placement annotations (the extender's
and the manager's ServiceAccounts), then webhook.trustedUsers. JSON list.
*/}}
{{- define "vcuda.webhook.trustedUsers" -}}
{{- $ns := .Release.Namespace }}
{{- $users := list (printf "system:serviceaccount:%s:vcuda-scheduler" $ns) (printf "system:serviceaccount:%s:gpu-manager" $ns) }}
{{- toJson (concat $users .Values.webhook.trustedUsers) }}
{{- end }}

{{/* The rules, selectors and client config both configurations share: .path, .operations. */}}
{{- define "vcuda.webhook.common" -}}
{{- $w := .root.Values.webhook }}
clientConfig:
  service:
    name: {{ include "vcuda.webhook.name" .root }}
    namespace: {{ .root.Release.Namespace }}
    path: {{ .path }}
    port: 443
  {{- with .caBundle }}
  caBundle: {{ . }}
  {{- end }}
rules:
  - apiGroups: [""]
    apiVersions: ["v1"]
    operations: {{ toJson .operations }}
    resources: ["pods"]
    scope: Namespaced
failurePolicy: {{ $w.failurePolicy }}
sideEffects: None
admissionReviewVersions: ["v1"]
timeoutSeconds: {{ $w.timeoutSeconds }}
{{- with $w.namespaceSelector }}
namespaceSelector:
  {{- toYaml . | nindent 2 }}
{{- end }}
{{- with $w.objectSelector }}
objectSelector:
  {{- toYaml . | nindent 2 }}
{{- end }}
{{- end }}
